"""Property-based: generated MoE blocks (shapes, dtypes, spellings, extra users of intermediates)
compile to exactly what eager gives, fused when the spelling is one we know; blocks that differ
semantically are rejected."""

import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


class GeneratedMoE(torch.nn.Module):
    def __init__(self, E, k, H, I, renorm, spelling, leak, deviation, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.E, self.k, self.H, self.renorm = E, k, H, renorm
        self.spelling, self.leak, self.deviation = spelling, leak, deviation
        self.router = torch.nn.Parameter(torch.randn(E, H, generator=gen) * 0.5)
        self.gate_up = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=gen) * H**-0.5)
        self.down = torch.nn.Parameter(torch.randn(E, H, I, generator=gen) * I**-0.5)

    def gmm(self, a, w, offs):
        if a.dtype == torch.bfloat16:
            return torch._grouped_mm(a, w, offs=offs)
        return torch.ops.transformers.grouped_mm_fallback(a, w, offs=offs)

    def forward(self, x):
        E, k, H = self.E, self.k, self.H
        T = x.shape[0]
        logits = F.linear(x, self.router)
        probs = (torch.softmax if self.spelling == "functions" else F.softmax)(logits, dim=-1, dtype=torch.float32)
        values, ids = torch.topk(probs, k, dim=-1)
        if self.renorm:
            if self.spelling == "functions":
                values = values / torch.sum(values, dim=-1, keepdim=True)
            else:
                values /= values.sum(dim=-1, keepdim=True)
        weights = values.to(x.dtype)
        ids_sorted, perm = torch.sort(ids.reshape(-1))
        rows = x[perm // k]
        row_weights = weights.reshape(-1)[perm]
        counts = torch.histc(ids_sorted.float(), bins=E, min=0, max=E - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = self.gmm(rows, self.gate_up.transpose(-2, -1), offsets)
        if self.deviation == "mask_everything":
            h = h.masked_fill((ids_sorted >= 0).unsqueeze(-1), 0.0)
        gate, up = h.chunk(2, dim=-1)
        y = self.gmm(F.silu(gate) * up, self.down.transpose(-2, -1), offsets)
        y = y * row_weights.unsqueeze(-1)
        inverse = torch.empty_like(perm)
        S = perm.shape[0]
        inverse[perm] = torch.arange(S - 1, -1, -1) if self.deviation == "reversed_unpermute" else torch.arange(S)
        view = y[inverse].view(T, k, H)
        out = torch.sum(view, dim=1) if self.spelling == "functions" else view.sum(dim=1)
        extra = {"none": (), "logits": (logits,), "gate_up": (h,), "perm": (perm.float(),)}[self.leak]
        return (out, *extra)


@st.composite
def blocks(draw, deviation=st.just("none")):
    E = draw(st.integers(2, 9))
    return dict(
        E=E,
        k=draw(st.integers(1, E)),
        H=draw(st.sampled_from([8, 16, 24])),
        I=draw(st.sampled_from([8, 16])),  # bf16 _grouped_mm wants 16-byte rows
        renorm=draw(st.booleans()),
        spelling=draw(st.sampled_from(["methods", "functions"])),
        leak=draw(st.sampled_from(["none", "logits", "gate_up", "perm"])),
        deviation=draw(deviation),
        seed=draw(st.integers(0, 2**16)),
    ), draw(st.sampled_from([torch.float32, torch.bfloat16])), draw(st.integers(1, 12))


def compile_and_run(params, dtype, T):
    torch._dynamo.reset()
    module = GeneratedMoE(**params).to(dtype)
    x = torch.randn(T, params["H"], generator=torch.Generator().manual_seed(params["seed"] + 1)).to(dtype)
    with tempfile.TemporaryDirectory() as folder:
        options = {"moe_fuse.inner": "eager", "moe_fuse.debug_dir": folder}
        got = torch.compile(module, backend="moe_fuse", options=options)(x)
        (report,) = [json.loads(p.read_text()) for p in Path(folder).glob("graph_*/report.json")]
    return module(x), got, report


SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@SETTINGS
@given(blocks())
def test_generated_blocks_are_fused_and_exact(case):
    params, dtype, T = case
    want, got, report = compile_and_run(params, dtype, T)
    assert sorted(m["pattern"] for m in report["matches"]) == ["grouped_mm_experts", "softmax_topk_router"], report
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for g, w in zip(got, want):
        if g.is_floating_point() and w.numel():
            assert ((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-12)).item() < tol
    # intermediates read outside the block are still computed, and still right
    assert len(got) == len(want)


@SETTINGS
@given(blocks(deviation=st.sampled_from(["reversed_unpermute", "mask_everything"])))
def test_semantic_deviations_are_rejected(case):
    params, dtype, T = case
    want, got, report = compile_and_run(params, dtype, T)
    experts = [r for r in report["rejected"] if r["pattern"] == "grouped_mm_experts"]
    # The walk reads the literal each deviation changes (the arange, the sentinel mask): no match.
    what = {"reversed_unpermute": "the un-permutation writes arange", "mask_everything": "sentinel mask is"}
    assert len(experts) == 1 and what[params["deviation"]] in experts[0]["reason"], report
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
