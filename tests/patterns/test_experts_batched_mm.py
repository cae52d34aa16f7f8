"""transformers' ``batched_mm`` experts (per-pair weight gather + bmm) fused into moe_fuse.experts:
parity with eager, the rewrite in the report, and near misses left alone."""

import json

import pytest
import torch
import torch.nn.functional as F

from support.models import loss_and_grads, qwen3_moe, rel_err, token_batch

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def reports(debug_dir):
    return [json.loads(p.read_text()) for p in sorted(debug_dir.glob("graph_*/report.json"))]


def compile_moe_fuse(model, debug_dir, inner="aot_eager", **kwargs):
    options = {"moe_fuse.inner": inner, "moe_fuse.debug_dir": str(debug_dir)}
    return torch.compile(model, backend="moe_fuse", options=options, **kwargs)


SPELLINGS = {
    "fp32": (torch.float32, False),
    # 5.24 under expert parallelism: ids.clamp(0, E-1) and weights.masked_fill(ids >= E, 0).
    "fp32_ep_sentinels": (torch.float32, True),
    "bf16": (torch.bfloat16, False),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_parity_and_rewrite(spelling, tmp_path):
    dtype, sentinels = SPELLINGS[spelling]
    model = qwen3_moe(dtype, expert_parallel_sentinels=sentinels)
    model.set_experts_implementation("batched_mm")
    ids = token_batch()
    eager = loss_and_grads(model, ids)
    fused = loss_and_grads(compile_moe_fuse(model, tmp_path), ids)
    tol = TOL[dtype]
    for a, b in zip(eager[:3], fused[:3]):
        assert rel_err(b, a) < tol
    assert eager[3].keys() == fused[3].keys()
    for name in eager[3]:
        assert rel_err(fused[3][name], eager[3][name]) < tol, name

    (report,) = [r for r in reports(tmp_path) if r["matches"]]
    patterns = sorted(m["pattern"] for m in report["matches"])
    assert patterns == ["batched_mm_experts"] * 2 + ["softmax_topk_router"] * 2
    assert [r for r in report["rejected"] if r["pattern"] == "batched_mm_experts"] == []
    m = next(m for m in report["matches"] if m["pattern"] == "batched_mm_experts")
    assert (m["num_experts"], m["top_k"], m["hidden"], m["intermediate"]) == (6, 2, 32, 16)
    assert m["verified"] and m["expert_parallel_sentinels"] is sentinels
    assert m["dtype"] == str(dtype).removeprefix("torch.")
    assert "layers.0.mlp.experts" in report["matches"][0]["where"] + report["matches"][1]["where"]

    folder = tmp_path / report["graph"]
    before, after = (folder / "before.py").read_text(), (folder / "after.py").read_text()
    assert "torch.bmm" in before and "repeat_interleave" in before
    assert after.count("torch.ops.moe_fuse.experts.default") == 2
    assert "torch.bmm" not in after and "repeat_interleave" not in after


def test_dynamic_token_count(tmp_path):
    model = qwen3_moe(torch.float32)
    model.set_experts_implementation("batched_mm")
    compiled = compile_moe_fuse(model, tmp_path, dynamic=True)
    for seq in (12, 7):
        ids = token_batch(seq=seq)
        eager, fused = loss_and_grads(model, ids), loss_and_grads(compiled, ids)
        assert rel_err(fused[0], eager[0]) < 1e-4
        for name in eager[3]:
            assert rel_err(fused[3][name], eager[3][name]) < 1e-4, name
    for report in [r for r in reports(tmp_path) if r["matches"]]:
        assert sorted(m["pattern"] for m in report["matches"]).count("batched_mm_experts") == 2


# --------------------------------------------------------------------------- hand-written variants

E, K, H, I = 6, 2, 32, 16


class HandWrittenBatchedMM(torch.nn.Module):
    """transformers' batched_mm experts written out by hand (routing given), with optional deviations."""

    def __init__(self, variant="exact"):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.variant = variant
        self.gate_up = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=gen) * 0.2)
        self.down = torch.nn.Parameter(torch.randn(E, H, I, generator=gen) * 0.2)

    def forward(self, x, top_k_index, top_k_weights):
        T = x.shape[0]
        xs = x.repeat_interleave(K, dim=0)
        w = top_k_weights.reshape(-1)
        ids = top_k_index.reshape(-1)
        mask = None
        if self.variant in ("sentinels", "mask_everything"):
            mask = ids >= E if self.variant == "sentinels" else ids >= 0  # the latter: always true
            ids = ids.clamp(0, E - 1)
        elif self.variant == "clamp_only":  # transformers 5.17's spelling
            ids = ids.clamp(0, E - 1)
        h = torch.bmm(self.gate_up[ids], xs.unsqueeze(-1)).squeeze(-1)
        gate, up = h.chunk(2, dim=-1)
        act = F.gelu(gate) if self.variant == "gelu" else F.silu(gate)
        y = torch.bmm(self.down[ids], (act * up).unsqueeze(-1)).squeeze(-1)
        if mask is not None:
            w = w.masked_fill(mask, 0.0)
        return (y * w.unsqueeze(-1)).view(T, K, H).sum(dim=1).to(x.dtype)


def routing(T=10, seed=3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    ids = torch.rand(T, E, generator=gen).argsort(dim=-1)[:, :K]
    weights = torch.rand(T, K, generator=gen) + 0.1
    return x, ids, weights


def run(variant, tmp_path):
    module = HandWrittenBatchedMM(variant)
    x, ids, weights = routing()
    want = module(x, ids, weights)
    options = {"moe_fuse.inner": "eager", "moe_fuse.debug_dir": str(tmp_path)}
    got = torch.compile(module, backend="moe_fuse", options=options)(x, ids, weights)
    (report,) = reports(tmp_path)
    return want, got, report


@pytest.mark.parametrize("variant", ["exact", "sentinels", "clamp_only"])
def test_hand_written_block_is_fused(variant, tmp_path):
    want, got, report = run(variant, tmp_path)
    (m,) = report["matches"]
    assert m["pattern"] == "batched_mm_experts" and report["rejected"] == []
    assert m["expert_parallel_sentinels"] is (variant == "sentinels")
    torch.testing.assert_close(got, want)


def test_semantic_difference_in_the_sentinel_mask_is_rejected(tmp_path):
    # The walk reads the sentinel mask: ids >= 0 masks every slot, not the slots of another rank's experts.
    want, got, report = run("mask_everything", tmp_path)
    assert report["matches"] == []
    (rejection,) = report["rejected"]
    assert rejection["pattern"] == "batched_mm_experts"
    assert rejection["reason"] == f"sentinel mask is ids >= 0, expected ids >= {E}"
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # exactly what eager gives


def test_structural_difference_is_rejected_with_its_reason(tmp_path):
    want, got, report = run("gelu", tmp_path)
    assert report["matches"] == []
    (rejection,) = report["rejected"]  # one line for the block, not one per bmm
    assert rejection["pattern"] == "batched_mm_experts"
    assert "gelu" in rejection["reason"] and "expected one silu" in rejection["reason"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_notes_reach_report_and_explain(tmp_path):
    """The 5.17 spelling (clamp without a sentinel mask) is proved on in-range ids only: the report says so."""
    import moe_fuse

    want, got, report = run("clamp_only", tmp_path)
    (m,) = report["matches"]
    note = f"expert ids clamped to [0, {E - 1}] without a sentinel mask: proved on in-range ids"
    assert m["notes"] == [note]
    assert f"note: {note}" in (tmp_path / "summary.txt").read_text()
    explanation = moe_fuse.explain(HandWrittenBatchedMM("clamp_only"), *routing())
    (m,) = explanation.matches
    assert m["notes"] == [note] and f"note: {note}" in str(explanation)
    # A match without notes has an empty list, so report.json has one shape.
    _, _, plain = run("exact", tmp_path / "exact")
    assert plain["matches"][0]["notes"] == []
