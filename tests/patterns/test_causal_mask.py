"""The constant causal mask transformers materialises under compile becomes SDPA's is_causal=True, and
the key / value heads transformers repeats for it are read unrepeated with enable_gqa=True.

Parity of loss, logits and every gradient with eager, the exact SDPA call after the rewrite, and
the cases that must stay as they are: the option off, one key / value head per query head. A tokenizer's mask
(causal AND key padding) becomes one FlexAttention call where FlexAttention compiles (a GPU), with the reason
where it does not.
"""

import json
import re

import pytest
import torch

from moe_fuse import config, dispatch
from support.models import loss_and_grads, qwen3_moe, rel_err, token_batch

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
    for call in calls:  # 4 query heads, 2 key / value heads: K and V as the layer computed them, not repeated
        assert re.fullmatch(r"q_embed(_\d+)?, k_embed(_\d+)?, value_states(_\d+)?, attn_mask = None, dropout_p = 0.0, "
                            r"scale = [0-9.]+, is_causal = True, enable_gqa = True", call), call
    assert "in repeat_kv" not in "".join(p.read_text() for p in tmp_path.glob("graph_*/after.py"))
    rewrites = [m for r in reports(tmp_path) for m in r["matches"] if m["pattern"] == "causal_sdpa_mask"]
    assert len(rewrites) == 2
    assert rewrites[0]["verified"] == "proved" and rewrites[0]["query_length"] == 12
    assert rewrites[0]["mask_shape"] == [2, 1, 12, 12] and rewrites[0]["gqa_group"] == 2


def test_one_key_value_head_per_query_head_needs_no_groups(tmp_path):
    model = qwen3_moe(attn_implementation="sdpa", num_key_value_heads=4, num_hidden_layers=1)
    ids = token_batch()
    eager = loss_and_grads(model, ids, use_cache=False)
    assert_parity(eager, compile_and_run(model, ids, tmp_path, use_cache=False))
    (call,) = sdpa_calls(tmp_path)
    assert "is_causal = True" in call and "enable_gqa" not in call, call
    (rewrite,) = [m for r in reports(tmp_path) for m in r["matches"] if m["pattern"] == "causal_sdpa_mask"]
    assert "gqa_group" not in rewrite


def padding_mask(ids, kind):
    mask = torch.ones_like(ids)
    if kind == "right":
        mask[1, -4:] = 0
    elif kind == "left":  # the second row's first three queries see no key at all
        mask[1, :3] = 0
    return mask


def test_padding_mask_on_the_cpu_stays_with_the_reason(tmp_path):
    """A tokenizer's mask is proved causal AND key padding, but FlexAttention's compiled backward needs a GPU: on
    the CPU the masked call stays, and so do the repeated heads (a masked SDPA takes no groups)."""
    model = qwen3_moe(attn_implementation="sdpa")
    ids = token_batch()
    attention_mask = padding_mask(ids, "left")
    eager = loss_and_grads(model, ids, use_cache=False, attention_mask=attention_mask)
    assert_parity(eager, compile_and_run(model, ids, tmp_path, use_cache=False, attention_mask=attention_mask))
    for call in sdpa_calls(tmp_path):
        assert "attn_mask = None" not in call and "is_causal = True" not in call and "enable_gqa" not in call, call
    reasons = [r["reason"] for rep in reports(tmp_path) for r in rep["rejected"] if r["pattern"] == "causal_sdpa_mask"]
    assert len(reasons) == 2 and all(reason.startswith("the mask reads graph input 'l_kwargs_attention_mask_'")
                                     and reason.endswith("FlexAttention's compiled backward needs a GPU (the query "
                                                         "is on cpu)") for reason in reasons), reasons


@pytest.mark.parametrize("flash_prefix", [False, True])
@pytest.mark.parametrize("kind", ["ones", "right", "left"])
def test_padded_mask_becomes_the_padded_attention_call(tmp_path, monkeypatch, kind, flash_prefix):
    """With the GPU's answer (FlexAttention applies), the masked call becomes
    attention.causal_prefix_padded_attention (config.flash_prefix, the default) or attention.causal_padded_attention
    on the mask's last query row, reading the unrepeated key / value heads: loss, logits (padded positions
    included) and every gradient as eager's masked SDPA. Inner aot_eager runs FlexAttention's own dense
    reference."""
    monkeypatch.setattr(dispatch, "padded_attention_applies", lambda q, k: None)
    model = qwen3_moe(attn_implementation="sdpa")
    ids = token_batch()
    attention_mask = padding_mask(ids, kind)
    eager = loss_and_grads(model, ids, use_cache=False, attention_mask=attention_mask)
    with config.patch(flash_prefix=flash_prefix):
        assert_parity(eager, compile_and_run(model, ids, tmp_path, use_cache=False, attention_mask=attention_mask))
    assert sdpa_calls(tmp_path) == []
    text = "".join(p.read_text() for p in sorted(tmp_path.glob("graph_*/after.py")))
    fn = "causal_prefix_padded_attention" if flash_prefix else "causal_padded_attention"
    calls = re.findall(rf"= moe_fuse_attention_{fn}\((.*)\)", text)
    assert len(calls) == 2 and "in repeat_kv" not in text
    for call in calls:  # q, unrepeated k and v, the mask's last query row, the layer's scale
        assert re.fullmatch(r"q_embed(_\d+)?, k_embed(_\d+)?, value_states(_\d+)?, getitem_\d+, 0\.35355\d*", call), call
    assert len(re.findall(r"= attention_mask_1\[\(slice\(None, None, None\), 0, -1, slice\(None, None, None\)\)\]",
                          text)) == 2
    rewrites = [m for r in reports(tmp_path) for m in r["matches"] if m["pattern"] == "causal_padded_sdpa_mask"]
    kernel = "sdpa_causal_prefix+flex_attention" if flash_prefix else "flex_attention"
    assert [(m["query_length"], m["kernel"], m["gqa_group"], m["verified"]) for m in rewrites] == [
        (12, kernel, 2, "proved")] * 2


class _Masked(torch.nn.Module):
    """SDPA with causal AND ``extra``, an input-dependent factor of the given shape."""

    def __init__(self, window=None):
        super().__init__()
        self.window = window

    def forward(self, q, k, v, extra):
        n = q.shape[-2]
        i = torch.arange(n)
        causal = i[None, :] <= i[:, None]
        if self.window:
            causal = causal & (i[:, None] - i[None, :] < self.window)
        mask = (causal[None, None] & extra.bool()).expand(q.shape[0], 1, n, n)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("window, extra_shape, reason", [
    (None, (2, 1, 7, 7), " (2, 1, 7, 7) varies along the query axis: not a key padding; as packed sequences: "
                         "bool_1 is not part of a packed-sequence mask"),
    (3, (2, 1, 1, 7), "the mask's constant part is not the plain causal mask (sliding window or packed sequences); "
                      "as packed sequences: a constant factor is neither all True nor causal"),
])
def test_masks_that_are_not_causal_and_key_padding_stay(tmp_path, monkeypatch, window, extra_shape, reason):
    monkeypatch.setattr(dispatch, "padded_attention_applies", lambda q, k: None)
    q, k, v = (torch.randn(2, 3, 7, 4, requires_grad=True) for _ in range(3))
    extra = torch.rand(extra_shape) > 0.3
    extra[..., 0] = True  # every query sees a key
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": str(tmp_path)}
    got = torch.compile(_Masked(window), backend="moe_fuse", options=options)(q, k, v, extra)
    torch.testing.assert_close(got, _Masked(window)(q, k, v, extra))
    (call,) = sdpa_calls(tmp_path)
    assert "attn_mask = None" not in call
    (rejected,) = [r["reason"] for rep in reports(tmp_path) for r in rep["rejected"]]
    assert rejected.startswith("the mask reads graph input 'l_extra_'") and rejected.endswith(reason), rejected


def test_padding_option_off_keeps_the_mask(tmp_path, monkeypatch):
    monkeypatch.setattr(dispatch, "padded_attention_applies", lambda q, k: None)
    model = qwen3_moe(attn_implementation="sdpa", num_hidden_layers=1)
    ids = token_batch()
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": str(tmp_path), "moe_fuse.causal_sdpa_flex": False}
    loss_and_grads(torch.compile(model, backend="moe_fuse", options=options), ids, use_cache=False,
                   attention_mask=padding_mask(ids, "right"))
    (call,) = sdpa_calls(tmp_path)
    assert "attn_mask = None" not in call


def test_option_off_keeps_the_mask(tmp_path):
    model = qwen3_moe(attn_implementation="sdpa", num_hidden_layers=1)
    ids = token_batch()
    compile_and_run(model, ids, tmp_path, causal_sdpa=False, use_cache=False)
    (call,) = sdpa_calls(tmp_path)
    assert "attn_mask = None" not in call and "enable_gqa" not in call


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
    assert calls and all("attn_mask = None" in c and "is_causal = True, enable_gqa = True" in c for c in calls), calls
    rewrites = [m for r in reports(tmp_path) for m in r["matches"] if m["pattern"] == "causal_sdpa_mask"]
    assert len(rewrites) == 2 and all("wrap_body" in m["where"] and m["gqa_group"] == 2 for m in rewrites)


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


class _GroupedAttention(torch.nn.Module):
    """transformers' repeat_kv in front of SDPA with a constant causal mask; ``keep`` also returns the repeated key."""

    def __init__(self, keep=False):
        super().__init__()
        self.keep = keep

    def forward(self, q, k, v):
        b, kvh, n, d = k.shape
        rep = q.shape[1] // kvh
        k2 = k[:, :, None, :, :].expand(b, kvh, rep, n, d).reshape(b, kvh * rep, n, d)
        v2 = v[:, :, None, :, :].expand(b, kvh, rep, n, d).reshape(b, kvh * rep, n, d)
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None].expand(b, 1, n, n)
        out = torch.nn.functional.scaled_dot_product_attention(q, k2, v2, attn_mask=mask)
        return (out, k2) if self.keep else out


def test_repeated_key_read_elsewhere_stays_for_that_reader(tmp_path):
    q = torch.randn(2, 6, 7, 4, requires_grad=True)
    k, v = (torch.randn(2, 2, 7, 4, requires_grad=True) for _ in range(2))
    want = _GroupedAttention(keep=True)(q, k, v)
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": str(tmp_path)}
    got = torch.compile(_GroupedAttention(keep=True), backend="moe_fuse", options=options)(q, k, v)
    dys = [torch.randn_like(t) for t in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dys), torch.autograd.grad(want, (q, k, v), dys)):
        torch.testing.assert_close(a, b)
    (call,) = sdpa_calls(tmp_path)
    assert call.startswith("l_q_, l_k_, l_v_, attn_mask = None") and call.endswith("is_causal = True, enable_gqa = True")
    text = "".join(p.read_text() for p in tmp_path.glob("graph_*/after.py"))
    assert ".expand(2, 2, 3, 7, 4)" in text and ".reshape(2, 6, 7, 4)" in text  # the key's repeat, for the output
    assert text.count(".expand(2, 2, 3, 7, 4)") == 1  # the value's is gone


def test_repeats_stay_where_sdpa_would_fall_back_to_math(tmp_path, monkeypatch):
    """Grouped heads only where torch picks a fused kernel for them: its math fallback would build the whole
    attention matrix (an fp32 model on a GPU, a head flash attention does not take)."""
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *a, **k: int(torch.nn.attention.SDPBackend.MATH))
    q = torch.randn(2, 6, 7, 4, requires_grad=True)
    k, v = (torch.randn(2, 2, 7, 4, requires_grad=True) for _ in range(2))
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": str(tmp_path)}
    got = torch.compile(_GroupedAttention(), backend="moe_fuse", options=options)(q, k, v)
    torch.testing.assert_close(got, _GroupedAttention()(q, k, v))
    (call,) = sdpa_calls(tmp_path)
    assert "is_causal = True" in call and "enable_gqa" not in call and not call.startswith("l_q_, l_k_")


def test_grouped_heads_off_keeps_the_repeats(tmp_path):
    """moe_fuse.causal_sdpa_grouped_heads=False (config.causal_sdpa_grouped_heads): the mask is rewritten, the
    repeated key / value heads stay."""
    q = torch.randn(2, 6, 7, 4, requires_grad=True)
    k, v = (torch.randn(2, 2, 7, 4, requires_grad=True) for _ in range(2))
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": str(tmp_path),
               "moe_fuse.causal_sdpa_grouped_heads": False}
    got = torch.compile(_GroupedAttention(), backend="moe_fuse", options=options)(q, k, v)
    torch.testing.assert_close(got, _GroupedAttention()(q, k, v))
    (call,) = sdpa_calls(tmp_path)
    assert "attn_mask = None" in call and "is_causal = True" in call and "enable_gqa" not in call, call
    (rewrite,) = [m for r in reports(tmp_path) for m in r["matches"] if m["pattern"] == "causal_sdpa_mask"]
    assert "gqa_group" not in rewrite


@pytest.mark.parametrize("positions", ["packed", "plain"])
def test_packed_sequences_become_one_flex_attention_call(tmp_path, monkeypatch, positions):
    """position_ids without an attention_mask: transformers masks each packed sequence to itself (and, under
    compile, builds that mask for plain positions too). Proved from the graph, it becomes
    attention.causal_document_attention on the document ids: loss, logits and every gradient as eager's."""
    monkeypatch.setattr(dispatch, "padded_attention_applies", lambda q, k: None)
    model = qwen3_moe(attn_implementation="sdpa")
    ids = token_batch()
    if positions == "packed":  # row 0: sequences of 5 and 7 tokens; row 1: 3, 3 and 6
        position_ids = torch.stack([torch.cat([torch.arange(5), torch.arange(7)]),
                                    torch.cat([torch.arange(3), torch.arange(3), torch.arange(6)])])
    else:
        position_ids = torch.arange(12).expand(2, 12)
    eager = loss_and_grads(model, ids, use_cache=False, position_ids=position_ids)
    assert_parity(eager, compile_and_run(model, ids, tmp_path, use_cache=False, position_ids=position_ids))
    assert sdpa_calls(tmp_path) == []
    text = "".join(p.read_text() for p in sorted(tmp_path.glob("graph_*/after.py")))
    calls = re.findall(r"= moe_fuse_attention_causal_document_attention\((.*)\)", text)
    assert len(calls) == 2 and "in repeat_kv" not in text
    for call in calls:  # q, unrepeated k and v, transformers' document ids, the layer's scale
        assert re.fullmatch(r"q_embed(_\d+)?, k_embed(_\d+)?, value_states(_\d+)?, packed_sequence_mask, "
                            r"0\.35355\d*", call), call
    rewrites = [m for r in reports(tmp_path) for m in r["matches"] if m["pattern"] == "causal_packed_sdpa_mask"]
    assert [(m["kernel"], m["gqa_group"]) for m in rewrites] == [("flex_attention", 2)] * 2


class _Packed(torch.nn.Module):
    """transformers' packed-sequence mask, written out, with one deviation at a time."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant

    def forward(self, q, k, v, pos):
        n = q.shape[-2]
        other = pos.flip(-1) if self.variant == "other_positions" else pos
        step = 2 if self.variant == "steps_of_two" else 1
        width = 2 if self.variant == "prepend_two" else 1
        docs = (torch.diff(other, prepend=other[:, :width] - 1, dim=-1) != step).cumsum(-1)
        b = torch.arange(q.shape[0])[:, None, None, None]
        qi = torch.arange(n)[None, None, :, None]
        ki = torch.arange(n)[None, None, None, :]
        order = pos[b, ki] >= pos[b, qi] if self.variant == "reversed_order" else pos[b, ki] <= pos[b, qi]
        mask = (torch.ones((), dtype=torch.bool) & order & (docs[b, qi] == docs[b, ki])).expand(q.shape[0], 1, n, n)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("variant, reason", [
    ("exact", None),
    ("steps_of_two", "the document ids do not count position steps other than +1"),
    ("other_positions", "the document ids come from other positions than the order"),
    ("reversed_order", "order is not positions[b, key] <= positions[b, query]"),
    ("prepend_two", "document ids (2, 10) are not [B, 9]"),  # ids shifted by one position
])
def test_packed_mask_deviations_stay(tmp_path, monkeypatch, variant, reason):
    monkeypatch.setattr(dispatch, "padded_attention_applies", lambda q, k: None)
    q, k, v = (torch.randn(2, 3, 9, 4, requires_grad=True) for _ in range(3))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1], [5, 6, 7, 8, 9, 10, 11, 12, 13]])
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": str(tmp_path)}
    want = _Packed(variant)(q, k, v, pos)
    got = torch.compile(_Packed(variant), backend="moe_fuse", options=options)(q, k, v, pos)
    torch.testing.assert_close(got, want)
    dy = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dy), torch.autograd.grad(want, (q, k, v), dy)):
        torch.testing.assert_close(a, b)
    if reason is None:
        assert sdpa_calls(tmp_path) == []
        (match,) = [m for r in reports(tmp_path) for m in r["matches"]]
        assert match["pattern"] == "causal_packed_sdpa_mask"
    else:
        (call,) = sdpa_calls(tmp_path)
        assert "attn_mask = None" not in call
        (rejected,) = [r["reason"] for rep in reports(tmp_path) for r in rep["rejected"]]
        assert rejected.endswith("as packed sequences: " + reason), rejected


@pytest.mark.parametrize("inputs", ["padded", "packed"])
def test_masks_inside_checkpointed_layers(tmp_path, monkeypatch, inputs):
    """Under activation checkpointing the mask is built outside each layer's body: it is followed out of the body
    and proved there. The body reads the padding from the mask's last query row, or the document ids from the
    positions that cannot see the one before (packed sequences)."""
    monkeypatch.setattr(dispatch, "padded_attention_applies", lambda q, k: None)
    model = qwen3_moe(attn_implementation="sdpa", output_router_logits=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = token_batch()
    if inputs == "padded":
        kwargs, pattern = {"attention_mask": padding_mask(ids, "right")}, "causal_padded_sdpa_mask"
    else:  # row 0: sequences of 5 and 7 tokens; row 1: 3, 3 and 6
        kwargs = {"position_ids": torch.stack([torch.cat([torch.arange(5), torch.arange(7)]),
                                               torch.cat([torch.arange(3), torch.arange(3), torch.arange(6)])])}
        pattern = "causal_packed_sdpa_mask"
    eager = loss_and_grads(model, ids, use_cache=False, **kwargs)
    loss, logits, _, grads = compile_and_run(model, ids, tmp_path, use_cache=False, **kwargs)
    assert rel_err(loss, eager[0]) < 1e-5 and rel_err(logits, eager[1]) < 1e-5
    for name in eager[3]:
        assert rel_err(grads[name], eager[3][name]) < 1e-4, name
    assert sdpa_calls(tmp_path) == []
    rewrites = [m for r in reports(tmp_path) for m in r["matches"] if m["pattern"] == pattern]
    assert len(rewrites) == 2 and all("wrap_body" in m["where"] and m["gqa_group"] == 2 for m in rewrites), rewrites
