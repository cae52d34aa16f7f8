"""The attention-mask rewrite on the GPU: a causal mask AND a tokenizer's key padding, compiled by
backend="moe_fuse" into one FlexAttention call, against float64 SDPA with the materialised mask (all ones, right
padding, left padding with rows that see no key), forward and backward; and a tiny Qwen3-MoE fed a padded batch."""

import pytest
import torch

from gpu_cases import rel_err

from moe_fuse import config
from moe_fuse.debug import collect_reports

pytestmark = pytest.mark.gpu


class MaskedAttention(torch.nn.Module):
    """transformers' SDPA call under compile: causal AND padding materialised as a [B, 1, L, L] bool mask, key and
    value heads repeated for the query heads."""

    def forward(self, q, k, v, attention_mask):
        b, kvh, n, d = k.shape
        rep = q.shape[1] // kvh
        k = k[:, :, None].expand(b, kvh, rep, n, d).reshape(b, kvh * rep, n, d)
        v = v[:, :, None].expand(b, kvh, rep, n, d).reshape(b, kvh * rep, n, d)
        causal = torch.arange(n, device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None]
        mask = (causal[None, None] & attention_mask.bool()[:, None, None, :]).expand(b, 1, n, n)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.1)


def padding(kind, batch, n):
    mask = torch.ones(batch, n, dtype=torch.long, device="cuda")
    if kind == "right":
        mask[0, n - n // 3:] = 0
        mask[1, n - 7:] = 0
    elif kind == "left":  # the first rows of a left-padded sequence see no key at all: zeros, as SDPA gives
        mask[0, :n // 4] = 0
        mask[1, :130] = 0
    return mask


@pytest.mark.parametrize("flash_prefix", [False, True])
@pytest.mark.parametrize("kind", ["ones", "right", "left"])
def test_padded_causal_attention_against_float64(kind, flash_prefix):
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, h, kvh, n, d = 2, 8, 2, 1000, 128  # n not a multiple of the 128-row tiles
    q, k, v, dy = (torch.randn(b, heads, n, d, device="cuda", generator=gen, dtype=torch.bfloat16)
                   for heads in (h, kvh, kvh, h))
    attention_mask = padding(kind, b, n)
    f64 = [t.double().requires_grad_() for t in (q, k, v)]
    want = MaskedAttention()(*f64, attention_mask)
    want_grads = torch.autograd.grad(want, f64, dy.double())
    torch._dynamo.reset()
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    with collect_reports() as reports, config.patch(flash_prefix=flash_prefix):
        got = torch.compile(MaskedAttention(), backend="moe_fuse")(*inputs, attention_mask)
        got_grads = torch.autograd.grad(got, inputs, dy)
    assert [m["pattern"] for r in reports for m in r.matches] == ["causal_padded_sdpa_mask"]
    assert rel_err(got, want) < 1e-2, rel_err(got, want)
    for name, g, w in zip("qkv", got_grads, want_grads):
        assert bool(torch.isfinite(g).all()) and rel_err(g, w) < 2e-2, (name, rel_err(g, w))
    if kind == "left":  # rows with no valid key: exactly zero, their gradients too
        assert got[0, :, : n // 4].abs().max().item() == 0 and want[0, :, : n // 4].abs().max().item() == 0
        assert got_grads[0][0, :, : n // 4].abs().max().item() == 0


def test_qwen3_moe_with_a_padded_batch():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         num_experts=8, num_experts_per_tok=2, attn_implementation="sdpa")
    model = Qwen3MoeForCausalLM(cfg).cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else None
    ids = torch.randint(0, 512, (2, 300), device="cuda")
    attention_mask = padding("right", 2, 300)
    labels = ids.masked_fill(attention_mask == 0, -100)

    def step(fn):
        model.zero_grad(set_to_none=True)
        out = fn(input_ids=ids, attention_mask=attention_mask, labels=labels, use_cache=False)
        out.loss.backward()
        return [out.loss.detach(), out.logits.detach()] + [p.grad.clone() for p in model.parameters()]

    eager = step(model)
    torch._dynamo.reset()
    with collect_reports() as reports:
        fused = step(torch.compile(model, backend="moe_fuse"))
    patterns = [m["pattern"] for r in reports for m in r.matches]
    assert patterns.count("causal_padded_sdpa_mask") == 2, "\n".join(r.summary() for r in reports)
    for i, (f, e) in enumerate(zip(fused, eager)):  # logits at padded positions included
        assert rel_err(f, e) < 5e-3, (i, rel_err(f, e))


class PackedAttention(torch.nn.Module):
    """transformers' mask for sequences packed into rows (position_ids restarting), materialised."""

    def forward(self, q, k, v, pos):
        n = q.shape[-2]
        docs = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        b = torch.arange(q.shape[0], device=q.device)[:, None, None, None]
        qi = torch.arange(n, device=q.device)[None, None, :, None]
        ki = torch.arange(n, device=q.device)[None, None, None, :]
        mask = ((pos[b, ki] <= pos[b, qi]) & (docs[b, qi] == docs[b, ki])).expand(q.shape[0], 1, n, n)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.1, enable_gqa=True)


def test_packed_sequences_against_float64():
    gen = torch.Generator(device="cuda").manual_seed(1)
    b, h, kvh, n, d = 2, 8, 2, 1000, 128
    q, k, v, dy = (torch.randn(b, heads, n, d, device="cuda", generator=gen, dtype=torch.bfloat16)
                   for heads in (h, kvh, kvh, h))
    lengths = [[300, 129, 571], [37] * 27 + [1]]
    pos = torch.stack([torch.cat([torch.arange(m) for m in row]) for row in lengths]).cuda()
    f64 = [t.double().requires_grad_() for t in (q, k, v)]
    want = PackedAttention()(*f64, pos)
    want_grads = torch.autograd.grad(want, f64, dy.double())
    torch._dynamo.reset()
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    with collect_reports() as reports:
        got = torch.compile(PackedAttention(), backend="moe_fuse")(*inputs, pos)
    assert [m["pattern"] for r in reports for m in r.matches] == ["causal_packed_sdpa_mask"]
    got_grads = torch.autograd.grad(got, inputs, dy)
    assert rel_err(got, want) < 1e-2, rel_err(got, want)
    for name, g, w in zip("qkv", got_grads, want_grads):
        assert bool(torch.isfinite(g).all()) and rel_err(g, w) < 2e-2, (name, rel_err(g, w))
