"""The constant causal mask transformers materialises under compile becomes SDPA's is_causal=True.

Parity of loss, logits and every gradient with eager, the exact SDPA call after the rewrite, and
the cases that must stay as they are: a user attention_mask with padding, the option off.
"""

import json
import re

import torch

from models import loss_and_grads, qwen3_moe, rel_err, token_batch

SDPA_LINE = re.compile(r"= torch\._C\._nn\.scaled_dot_product_attention\((.*)\)")


def compile_and_run(model, ids, tmp_path, causal_sdpa=True, **kwargs):
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": str(tmp_path), "moe_fuse.causal_sdpa": causal_sdpa}
    return loss_and_grads(torch.compile(model, backend="moe_fuse", options=options), ids, **kwargs)


def sdpa_calls(tmp_path) -> list[str]:
    text = "".join(p.read_text() for p in sorted(tmp_path.glob("graph_*/after.py")))
    return SDPA_LINE.findall(text)


def reports(tmp_path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("graph_*/report.json"))]


def assert_parity(eager, fused):
    loss, logits, aux, grads = eager
    loss2, logits2, aux2, grads2 = fused
    assert rel_err(loss2, loss) < 1e-5 and rel_err(logits2, logits) < 1e-5 and rel_err(aux2, aux) < 1e-5
    assert grads.keys() == grads2.keys()
    for name in grads:
        assert rel_err(grads2[name], grads[name]) < 1e-4, name


def test_plain_causal_mask_becomes_is_causal(tmp_path):
    model = qwen3_moe(attn_implementation="sdpa")
    ids = token_batch()
    eager = loss_and_grads(model, ids, use_cache=False)
    assert_parity(eager, compile_and_run(model, ids, tmp_path, use_cache=False))
    calls = sdpa_calls(tmp_path)
    assert len(calls) == 2
    for call in calls:
        assert "attn_mask = None" in call and "is_causal = True" in call, call
    rewrites = [m for r in reports(tmp_path) for m in r["matches"] if m["pattern"] == "causal_sdpa_mask"]
    assert len(rewrites) == 2
    assert rewrites[0]["verified"] == "proved" and rewrites[0]["query_length"] == 12
    assert rewrites[0]["mask_shape"] == [2, 1, 12, 12]


def test_padding_mask_is_left_alone(tmp_path):
    model = qwen3_moe(attn_implementation="sdpa")
    ids = token_batch()
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0  # left padding in the second row
    eager = loss_and_grads(model, ids, use_cache=False, attention_mask=attention_mask)
    assert_parity(eager, compile_and_run(model, ids, tmp_path, use_cache=False, attention_mask=attention_mask))
    for call in sdpa_calls(tmp_path):
        assert "attn_mask = None" not in call and "is_causal = True" not in call, call
    reasons = [r["reason"] for rep in reports(tmp_path) for r in rep["rejected"] if r["pattern"] == "causal_sdpa_mask"]
    assert reasons and all("reads graph input" in reason for reason in reasons), reasons


def test_option_off_keeps_the_mask(tmp_path):
    model = qwen3_moe(attn_implementation="sdpa", num_hidden_layers=1)
    ids = token_batch()
    compile_and_run(model, ids, tmp_path, causal_sdpa=False, use_cache=False)
    (call,) = sdpa_calls(tmp_path)
    assert "attn_mask = None" not in call


def test_mask_built_outside_checkpointed_layers(tmp_path):
    """Under activation checkpointing the mask is computed in the outer graph and passed into each
    layer's body: it is followed out of the body and proved there."""
    model = qwen3_moe(attn_implementation="sdpa", output_router_logits=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = token_batch()
    eager = loss_and_grads(model, ids, use_cache=False)
    loss, logits, _, grads = compile_and_run(model, ids, tmp_path, use_cache=False)
    assert rel_err(loss, eager[0]) < 1e-5 and rel_err(logits, eager[1]) < 1e-5
    for name in eager[3]:
        assert rel_err(grads[name], eager[3][name]) < 1e-4, name
    calls = sdpa_calls(tmp_path)
    assert calls and all("attn_mask = None" in c and "is_causal = True" in c for c in calls), calls
    rewrites = [m for r in reports(tmp_path) for m in r["matches"] if m["pattern"] == "causal_sdpa_mask"]
    assert len(rewrites) == 2 and all("wrap_body" in m["where"] for m in rewrites)


class _CountingAttention(torch.nn.Module):
    """A constant causal mask next to an in-place op whose result nobody reads."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, q, k, v):
        n = q.shape[-2]
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None].expand(q.shape[0], 1, n, n)
        self.calls.add_(1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_rewrite_keeps_unrelated_in_place_ops(tmp_path):
    q, k, v = (torch.randn(2, 3, 7, 4, requires_grad=True) for _ in range(3))
    want = _CountingAttention()(q, k, v)
    module = _CountingAttention()
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": str(tmp_path)}
    got = torch.compile(module, backend="moe_fuse", options=options)(q, k, v)
    assert module.calls.item() == 1  # the buffer update survived the rewrite
    torch.testing.assert_close(got, want)
    dy = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dy), torch.autograd.grad(want, (q, k, v), dy)):
        torch.testing.assert_close(a, b)
    (call,) = sdpa_calls(tmp_path)
    assert "attn_mask = None" in call and "is_causal = True" in call
