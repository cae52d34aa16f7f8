"""Verification: a graph that looks like MoE but computes something else is left alone."""

import json
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)

E, K, H, I = 6, 2, 32, 16


class HandWrittenMoE(torch.nn.Module):
    """transformers' grouped_mm MoE block written out by hand, with optional deviations."""

    def __init__(self, variant="exact"):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.variant = variant
        self.router = torch.nn.Parameter(torch.randn(E, H, generator=gen) * 0.3)
        self.gate_up = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=gen) * 0.2)
        self.down = torch.nn.Parameter(torch.randn(E, H, I, generator=gen) * 0.2)

    def forward(self, x):
        T = x.shape[0]
        logits = F.linear(x, self.router)
        values, ids = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), K, dim=-1)
        values /= values.sum(dim=-1, keepdim=True)
        weights = values.to(x.dtype)
        ids_sorted, perm = torch.sort(ids.reshape(-1))
        rows = x[perm // K]
        row_weights = weights.reshape(-1)[perm]
        offsets = torch.cumsum(torch.histc(ids_sorted.float(), bins=E, min=0, max=E - 1), dim=0, dtype=torch.int32)
        h = torch.ops.transformers.grouped_mm_fallback(rows, self.gate_up.transpose(-2, -1), offs=offsets)
        if self.variant == "mask_everything":  # a sentinel mask that is always true
            h = h.masked_fill((ids_sorted >= 0).unsqueeze(-1), 0.0)
        gate, up = h.chunk(2, dim=-1)
        y = torch.ops.transformers.grouped_mm_fallback(F.silu(gate) * up, self.down.transpose(-2, -1), offs=offsets)
        y = y * row_weights.unsqueeze(-1)
        inverse = torch.empty_like(perm)
        S = perm.shape[0]
        if self.variant == "reversed_unpermute":  # rows returned to the wrong tokens
            inverse[perm] = torch.arange(S - 1, -1, -1)
        else:
            inverse[perm] = torch.arange(S)
        return y[inverse].view(T, K, H).sum(dim=1), logits


def run(variant, tmp_path, verify=True, tokens=10, verify_tokens=None):
    torch._dynamo.reset()
    module = HandWrittenMoE(variant)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(3))
    want = module(x)
    options = {"moe_fuse.inner": "eager", "moe_fuse.debug_dir": str(tmp_path), "moe_fuse.verify": verify}
    if verify_tokens is not None:
        options["moe_fuse.verify_tokens"] = verify_tokens
    got = torch.compile(module, backend="moe_fuse", options=options)(x)
    (report_file,) = tmp_path.glob("graph_*/report.json")
    return want, got, json.loads(report_file.read_text())


def test_hand_written_block_is_fused(tmp_path):
    want, got, report = run("exact", tmp_path)
    assert sorted(m["pattern"] for m in report["matches"]) == ["grouped_mm_experts", "softmax_topk_router"]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("variant, reason", [
    ("reversed_unpermute", "the un-permutation writes arange(19, -1, -1) into inv, expected arange(0, 20, 1)"),
    ("mask_everything", "sentinel mask is ids_sorted >= 0, expected ids_sorted >= 6"),
])
@pytest.mark.parametrize("verify", [True, False])
def test_semantic_difference_is_rejected_and_results_unchanged(variant, reason, verify, tmp_path):
    # The walk reads every literal the fused op assumes: these are no match, verification on or off.
    want, got, report = run(variant, tmp_path, verify=verify)
    assert [m["pattern"] for m in report["matches"]] == ["softmax_topk_router"]
    (rejection,) = report["rejected"]
    assert rejection["pattern"] == "grouped_mm_experts"
    assert rejection["reason"] == reason
    assert rejection["where"]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)  # what eager gives


def _disagreeing_op(monkeypatch):
    """The grouped_mm experts candidates with an op whose output is 1% off: what verification is for (a fused op
    that disagrees with the block it replaces, whatever the walk read)."""
    from moe_fuse.patterns import experts_grouped_mm

    match = experts_grouped_mm.match

    def match_with_a_wrong_op(node):
        cand = match(node)
        op = cand.op

        def off_by_one_percent(*args):
            return op(*args)[0] * 1.01

        cand.op, cand.output_index = off_by_one_percent, [None]  # one tensor, the block's output
        return cand

    monkeypatch.setattr(experts_grouped_mm, "match", match_with_a_wrong_op)


def test_a_fused_op_that_disagrees_is_rejected_and_results_unchanged(monkeypatch, tmp_path):
    _disagreeing_op(monkeypatch)
    want, got, report = run("exact", tmp_path)
    assert [m["pattern"] for m in report["matches"]] == ["softmax_topk_router"]
    (rejection,) = report["rejected"]
    assert rejection["pattern"] == "grouped_mm_experts"
    assert "differs: relative error" in rejection["reason"]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


class _WrongGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, dy):
        return dy * 1.01


@pytest.mark.parametrize("grad", [True, False])
def test_an_inference_graph_is_proven_on_its_outputs_alone(monkeypatch, grad):
    # An op whose forward is right and whose backward is 1% off: rejected where a gradient flows through the block,
    # fused in a graph compiled under no_grad, whose backward never runs (verification computes no gradient there).
    from moe_fuse.debug import collect_reports
    from moe_fuse.patterns import experts_grouped_mm

    match = experts_grouped_mm.match

    def match_with_a_wrong_backward(node):
        cand = match(node)
        op = cand.op
        cand.op, cand.output_index = (lambda *args: _WrongGradient.apply(op(*args)[0])), [None]
        return cand

    monkeypatch.setattr(experts_grouped_mm, "match", match_with_a_wrong_backward)
    module, x = HandWrittenMoE(), torch.randn(10, H, generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad), collect_reports() as reports:
        got = torch.compile(module, backend="moe_fuse", options={"moe_fuse.inner": "eager"})(x)
    fused = sorted(m["pattern"] for r in reports for m in r.matches)
    if grad:
        assert fused == ["softmax_topk_router"]
        (rejection,) = [r for rep in reports for r in rep.rejected]
        assert rejection["reason"].startswith("gradient of ") and "differs" in rejection["reason"], rejection
    else:
        assert fused == ["grouped_mm_experts", "softmax_topk_router"]
    for g, w in zip(got, module(x)):
        torch.testing.assert_close(g, w)


def test_without_verification_a_disagreeing_op_would_be_fused(monkeypatch, tmp_path):
    # Why verification is on by default: the walk proves the block is the pattern, not that the op computes it.
    _disagreeing_op(monkeypatch)
    want, got, report = run("exact", tmp_path, verify=False)
    assert sorted(m["pattern"] for m in report["matches"]) == ["grouped_mm_experts", "softmax_topk_router"]
    assert all(m["verified"] is False for m in report["matches"])
    assert not torch.allclose(got[0], want[0])


def _experts(report):
    (match,) = [m for m in report["matches"] if m["pattern"] == "grouped_mm_experts"]
    return match


def test_a_long_block_is_proven_on_fewer_tokens(tmp_path):
    want, got, report = run("exact", tmp_path, tokens=300, verify_tokens=64)
    assert _experts(report)["notes"] == ["proven on 64 of its 300 tokens (verify_tokens)"]
    torch.testing.assert_close(got, want)


def test_a_disagreeing_op_is_rejected_on_fewer_tokens(monkeypatch, tmp_path):
    _disagreeing_op(monkeypatch)
    want, got, report = run("exact", tmp_path, tokens=300, verify_tokens=64)
    (rejection,) = report["rejected"]
    assert "differs: relative error" in rejection["reason"]
    assert rejection["reason"].endswith("(proven on 64 of its 300 tokens (verify_tokens))")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_a_hidden_size_equal_to_the_token_count_scales_with_them(monkeypatch, tmp_path):
    # T == H (a 235B layer at T=4096): no literal says which of the two it is, and the block means the same at any H.
    monkeypatch.setattr(sys.modules[__name__], "I", 24)  # 2I != H
    want, got, report = run("exact", tmp_path, tokens=H, verify_tokens=8)
    assert _experts(report)["notes"] == [f"proven on 8 of its {H} tokens (verify_tokens), the hidden size {H} as 8 "
                                         "with them"]
    torch.testing.assert_close(got, want)


def test_a_smaller_run_that_raises_is_proven_at_the_real_size(tmp_path):
    # T == H == 2I: scaling every 32 makes the gate / up halves disagree with the down projection, which raises.
    assert 2 * I == H
    want, got, report = run("exact", tmp_path, tokens=H, verify_tokens=5)
    (note,) = _experts(report)["notes"]
    assert note.startswith("proven at the real size: on 5 tokens verification raised"), note
    torch.testing.assert_close(got, want)


def test_a_token_count_that_is_another_size_is_proven_at_the_real_size(tmp_path):
    want, got, report = run("exact", tmp_path, tokens=I, verify_tokens=5)  # T == I: which literal is which?
    assert _experts(report)["notes"] == [
        f"proven at the real size: the token count's sizes [{I}] are also other sizes of the block"]
    torch.testing.assert_close(got, want)


def test_a_literal_the_block_does_not_scale_by_keeps_the_real_size(monkeypatch):
    # An S - 1 (or any literal above the smaller size that is not a size of the block) could mean something else
    # at the smaller size: such a block is proven at its real size.
    from moe_fuse import config
    from moe_fuse.patterns import experts_grouped_mm
    from moe_fuse.pipeline.verify import token_sizes

    seen, match = [], experts_grouped_mm.match
    monkeypatch.setattr(experts_grouped_mm, "match", lambda node: seen.append(match(node)) or seen[-1])
    torch._dynamo.reset()
    torch.compile(HandWrittenMoE(), backend="moe_fuse", options={"moe_fuse.inner": "eager"})(torch.randn(300, H))
    (cand,) = [c for c in seen if c is not None]
    with config.patch(verify_tokens=64):
        assert token_sizes(cand) == ({300: 64, 600: 128}, "proven on 64 of its 300 tokens (verify_tokens)")
        (arange,) = [n for n in cand.region.nodes if n.target is torch.arange]
        arange.args = (599,)
        assert token_sizes(cand) == (None, "proven at the real size: literal 599 at arange is not a size the block "
                                           "scales by")
    with config.patch(verify_tokens=0):
        assert token_sizes(cand) == (None, None)


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The bytes of tensors created under it that are still alive, and the most at any one time."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        known = {a.untyped_storage().data_ptr() for a in flat if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:  # new storage only, not views of inputs
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in known:
                size = t.untyped_storage().nbytes()
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, size)
        return out

    def _free(self, size):
        self.live -= size


def test_rel_err_is_float64_exact_and_holds_a_few_rows():
    """The comparison is the float64 norm ratio (non-contiguous, 0-d, NaN and all-zero inputs too), computed a chunk
    of rows at a time: never the whole tensor in float64."""
    from moe_fuse.pipeline.verify import CHUNK, rel_err

    gen = torch.Generator().manual_seed(0)
    want = torch.randn(64, 3, 50, generator=gen).transpose(0, 2)
    got = want + 1e-3 * torch.randn(want.shape, generator=gen)
    exact = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert rel_err(got, want) == pytest.approx(exact, rel=1e-12)
    assert rel_err(torch.tensor(3.0), torch.tensor(2.0)) == pytest.approx(0.5)
    assert rel_err(torch.ones(4), torch.zeros(4)) == pytest.approx(2.0)
    assert rel_err(torch.tensor([1.0, float("nan")]), torch.ones(2)) == float("inf")
    big = torch.randn(512, 1 << 16, generator=gen).bfloat16()  # 2^25 elements, 64 MB
    other = big + 1
    with _LiveBytes() as mem:
        rel_err(other, big)
    assert mem.peak <= 4 * 8 * CHUNK + (1 << 20)  # a few float64 chunks, against 3 x 256 MB made whole
