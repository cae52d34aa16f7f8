"""GPT-OSS's experts: a bias per expert on both projections and gate / up rows interleaved in gate_up
(``gate = h[..., ::2]``, ``up = h[..., 1::2]``), with its clamped gate (limit 7, alpha 1.702), in every layer.

The op (through ``ops.experts_with_biases``) against a naive float64 definition with autograd; the
grouped_mm path's kernels (SwiGLU / dSwiGLU passes with the bias and the interleaved columns, the per-expert
bias-gradient sums) in the interpreter against the float64 reference; the dispatch; the errors; the pattern
(what it matches, what it refuses); the eager experts interface on a tiny GPT-OSS model.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from support import families  # noqa: E402
from support.cases import BIAS_NAMES as NAMES  # noqa: E402
from support.cases import DEVICE, biases, make_case, poisoned_buffers, random_case, rel_err  # noqa: E402
from support.steps import compare, experts_entries  # noqa: E402

from moe_fuse import config, dispatch  # noqa: E402
from support.paths import grouped_mm_backward, grouped_mm_forward  # noqa: E402
from moe_fuse import kernels, ops, reference  # noqa: E402
from moe_fuse.kernels import backward, grouped_mm_path  # noqa: E402
from moe_fuse.kernels.routing import route  # noqa: E402
from moe_fuse.spec import Epilogue  # noqa: E402

LIMIT, ALPHA = 7.0, 1.702  # GPT-OSS's
GPT_OSS = Epilogue(swiglu_limit=LIMIT, glu_alpha=ALPHA, interleaved=True)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def naive_experts(x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, limit=None, alpha=None, interleaved=True):
    """transformers' GPT-OSS expert loop, token by token (b_* may be None)."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= w_gate_up.shape[0]:  # an expert-parallel sentinel: another rank's expert
                continue
            h = w_gate_up[e] @ x[t] + (0 if b_gate_up is None else b_gate_up[e])
            gate, up = (h[::2], h[1::2]) if interleaved else h.chunk(2)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            act = torch.nn.functional.silu(gate) * up if alpha is None else gate * torch.sigmoid(gate * alpha) * (up + 1)
            acc = acc + weights[t, j] * (w_down[e] @ act + (0 if b_down is None else b_down[e]))
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("which", ["both", "gate_up", "down", "interleaved_only"])
@pytest.mark.parametrize("save_h", [False, True])
def test_op_matches_naive_definition_and_its_autograd(save_h, which):
    x, ids, weights, w_gate_up, w_down = random_case(k=2, sentinel_fraction=0.2)
    E, two_i, H = w_gate_up.shape
    b_gu, b_d = biases(E, two_i, H)
    b_gu = b_gu if which in ("both", "gate_up") else None
    b_d = b_d if which in ("both", "down") else None
    w_gate_up = w_gate_up * 4  # |h| up to ~10: both clamps at 7 are active
    leaves = [t.requires_grad_() for t in (x, weights, w_gate_up, w_down, *(b for b in (b_gu, b_d) if b is not None))]
    got = ops.experts_with_biases(x, ids, weights, w_gate_up, w_down, b_gu, b_d, save_h, GPT_OSS)
    want = naive_experts(x, ids, weights, w_gate_up, w_down, b_gu, b_d, LIMIT, ALPHA)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # each of the bias and the interleaving changes the result: the test can fail
    concat = naive_experts(x, ids, weights, w_gate_up, w_down, b_gu, b_d, LIMIT, ALPHA, interleaved=False)
    assert (concat - want).abs().max() > 0.1
    if which != "interleaved_only":
        assert (naive_experts(x, ids, weights, w_gate_up, w_down, None, None, LIMIT, ALPHA) - want).abs().max() > 0.1
    dy = torch.randn_like(want)
    for g_got, g_want in zip(torch.autograd.grad(got, leaves, dy), torch.autograd.grad(want, leaves, dy)):
        torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-10)


def test_bad_biases_are_named():
    x, ids, weights, w_gate_up, w_down = random_case()
    E, two_i, H = w_gate_up.shape
    with pytest.raises(ValueError, match=r"gate_up_bias must be a float \[E=5, 2I=20\] tensor, got \(5, 10\)"):
        torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, False, "silu",
                                   torch.zeros(E, two_i // 2, dtype=x.dtype))
    with pytest.raises(ValueError, match=r"down_bias must be \[E=5, H=12\], got \(5, 20\)"):
        ops.experts_with_biases(x, ids, weights, w_gate_up, w_down, None, torch.zeros(E, two_i, dtype=x.dtype))
    # the all-Triton kernels have no bias: asking them for one is an error, not a silently biasless result
    args = make_case(8, 2, 4, 16, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="run on grouped_mm_path only"):
        dispatch.experts_forward(*args, gate_up_bias=torch.zeros(4, 16).to(DEVICE))
    with pytest.raises(ValueError, match="run on grouped_mm_path only"):
        dispatch.experts_backward(torch.randn(8, 16).to(DEVICE), *args, interleaved=True)


CASES = {
    # name: (T, k, E, H, I, dtype, mode)
    "uneven_fp32": (24, 3, 6, 40, 24, torch.float32, "skewed"),  # heavy experts, some empty
    "uneven_bf16": (24, 3, 6, 40, 24, torch.bfloat16, "skewed"),
    "ep_sentinels_fp32": (20, 2, 4, 32, 16, torch.float32, "sentinels"),
}


def ref64(args, gate, dy=None):
    cpu = [t.cpu().double() if t.is_floating_point() else t.cpu() for t in args]
    gate = {**gate, "gate_up_bias": gate["gate_up_bias"].cpu().double()}
    if dy is None:
        return reference.experts_forward(*cpu, **gate)
    return reference.experts_backward(dy.cpu().double(), *cpu, **gate)


def check(got, want, tol, names):
    for name, g, r in zip(names, got, want):
        assert bool(torch.isfinite(g).all()), f"{name}: some element was never written"
        err = rel_err(g.cpu(), r)
        assert err < tol, f"{name}: rel. error {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("alpha", [None, ALPHA], ids=["silu", "gpt_oss_gate"])
@pytest.mark.parametrize("ragged", [True, False], ids=["ragged_triton", "grouped_mm"])
@pytest.mark.parametrize("name", list(CASES))
def test_grouped_mm_path_matches_reference(name, ragged, alpha, monkeypatch):
    """On CPU torch's grouped GEMM fallback (or ragged_gemm) and the interpreter; on sm90 CUTLASS."""
    monkeypatch.setattr(config, "ragged_gemm", ragged)
    monkeypatch.setattr(config, "ragged_min_rows", 0)
    T, k, E, H, I, dtype, mode = CASES[name]
    args = make_case(T, k, E, H, I, dtype, mode, seed=len(name))
    b_gu = biases(E, 2 * I, H, dtype)[0].to(DEVICE)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    # no clamps here: a bf16 value within rounding of the bound would get or lose its whole gradient against
    # the float64 reference (test_swiglu_limit.py measures the clamps on both paths)
    gate = {"glu_alpha": alpha, "gate_up_bias": b_gu, "interleaved": True}
    with poisoned_buffers(monkeypatch):
        y, h, routing, xs, aw = grouped_mm_forward(*args, save_h=True, keep_rows=True, **gate)
        kept = grouped_mm_backward(dy, *args, h, routing=routing, xs=xs, aw=aw, **gate)
        recomputed = grouped_mm_backward(dy, *args, **gate)
    check([y], [ref64(args, gate)], TOL[dtype], ["y"])
    want = ref64(args, gate, dy)
    assert len(kept) == 5 and kept[4].shape == (E, 2 * I) and kept[4].dtype == dtype
    check(kept, want, TOL[dtype], NAMES)
    for a, b in zip(kept, recomputed):  # what the forward kept is what the backward recomputes
        assert torch.equal(a, b)
    # the bias and the interleaving both matter in this case
    plain = grouped_mm_forward(*args, glu_alpha=alpha)
    assert rel_err(plain.cpu(), ref64(args, gate)) > 10 * TOL[dtype]
    concat = grouped_mm_forward(*args, **{**gate, "interleaved": False})
    assert rel_err(concat.cpu(), ref64(args, gate)) > 10 * TOL[dtype]


def test_expert_sums_are_each_experts_rows_in_fp32():
    """The bias-gradient kernel: every expert's rows summed (zero for an expert without rows), sentinel rows in
    no sum; rows of several BLOCK_R steps and columns past a BLOCK_N multiple."""
    gen = torch.Generator().manual_seed(2)
    E = 5
    ids = torch.tensor([0, 0, 3, 3, 3, 1, 5, 5] * 6).view(-1, 2)  # expert 2 and 4 get none, 5 is a sentinel
    routing = route(ids.to(DEVICE), E)
    rows = torch.randn(ids.numel(), 37, generator=gen).to(torch.bfloat16).to(DEVICE)
    got = backward.expert_sums(rows, routing, torch.float32)
    off = routing.offsets.tolist()
    want = torch.stack([rows[off[e]:off[e + 1]].double().sum(0) for e in range(E)])
    assert got.dtype == torch.float32 and got.shape == (E, 37)
    torch.testing.assert_close(got.double().cpu(), want.cpu(), rtol=1e-6, atol=1e-6)
    assert bool((got[2] == 0).all()) and bool((got[4] == 0).all())


def test_dispatch_takes_grouped_mm_path_or_the_reference(monkeypatch):
    """With a bias or interleaved rows even the forward without h takes grouped_mm_path; where that path does
    not apply, the op computes them with the reference (never the biasless all-Triton kernels)."""
    calls = []
    real = grouped_mm_path.experts_forward
    monkeypatch.setattr(grouped_mm_path, "experts_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, ids, weights, w_gate_up, w_down = make_case(12, 2, 4, 16, 8, torch.float32, seed=6)
    b_gu = biases(4, 16, 16, torch.float32)[0].to(DEVICE)
    assert not dispatch.supports(x, ids, weights, w_gate_up, w_down, extras=True)  # the path does not apply here
    want = reference.experts_forward(x, ids, weights, w_gate_up, w_down, gate_up_bias=b_gu, interleaved=True)
    monkeypatch.setattr(dispatch, "grouped_mm_applies", lambda *a: True)
    assert dispatch.supports(x, ids, weights, w_gate_up, w_down, extras=True)
    got = dispatch.experts_forward(x, ids, weights, w_gate_up, w_down, gate_up_bias=b_gu, interleaved=True)
    assert calls == [1] and rel_err(got, want.double()) < 1e-5


# --------------------------------------------------------------------------- pattern, eager interface


def test_gpt_oss_is_fused_with_its_biases_and_interleaved_rows(tmp_path):
    model, inputs = families.build("gpt_oss")
    eager, fused, reports = compare(model, inputs, tmp_path)
    matches = experts_entries(reports, "matches")
    assert len(matches) == 2 and all(m["verified"] for m in matches), matches
    for m in matches:
        assert (m["layout"], m["gate_up_bias"], m["down_bias"], m["swiglu_limit"], m["glu_alpha"]) == (
            "gate_up_interleaved", True, True, 7.0, 1.702), m
    after = "".join(p.read_text() for p in tmp_path.glob("graph_*/after.py"))
    assert after.count("torch.ops.moe_fuse.experts.default(") == 2
    assert after.count(", True, 'silu(swiglu_limit=7.0, glu_alpha=1.702, interleaved=True)', ") == 2
    assert "scatter_add" in after  # the down bias's routing-weighted GEMM
    pairs = [("loss", fused[0], eager[0]), ("output", fused[1], eager[1])]
    pairs += [(f"grad {n}", fused[3][n], g) for n, g in eager[3].items()]
    for what, a, b in pairs:
        assert families.rel_err(a, b) < families.TOLERANCE, what
    assert any("experts.gate_up_proj_bias" in n for n in eager[3]) and any("down_proj_bias" in n for n in eager[3])


def test_an_add_that_is_not_a_bias_is_left_alone(tmp_path, monkeypatch):
    """The gate_up output plus something other than a per-expert bias row: no match, the reason names it, and the
    step is eager's."""
    from transformers.integrations import moe

    real = moe._grouped_linear

    def shifted(input, weight, offs, bias=None, is_transposed=False):
        out = real(input, weight, offs, bias=None, is_transposed=is_transposed)
        return out.add_(bias.mean(0)) if bias is not None else out  # one row for every expert: not a bias

    monkeypatch.setattr(moe, "_grouped_linear", shifted)
    model, inputs = families.build("gpt_oss")
    eager, fused, reports = compare(model, inputs, tmp_path)
    rejected = experts_entries(reports, "rejected")
    assert len(rejected) == 2 and all("not a bias gathered by the sorted expert ids" in r["reason"]
                                      for r in rejected), rejected
    assert families.rel_err(fused[0], eager[0]) < families.TOLERANCE


def test_eager_interface_runs_gpt_oss_experts_as_the_op(recwarn):
    import moe_fuse
    from moe_fuse.integrations.transformers import gate_epilogue, unsupported_reason

    model, inputs = families.build("gpt_oss")
    eager = families.loss_and_grads(model, inputs)
    calls = []
    real = ops.experts_with_biases
    moe_fuse.register_experts_implementation()
    model.set_experts_implementation("moe_fuse")
    experts = [m for m in model.modules() if type(m).__name__ == "GptOssExperts"]
    assert experts and all(unsupported_reason(m) is None and gate_epilogue(m) == GPT_OSS for m in experts)
    try:
        ops.experts_with_biases = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        fused = families.loss_and_grads(model, inputs)
    finally:
        ops.experts_with_biases = real
    assert len(calls) == len(experts)
    assert not [w for w in recwarn if "moe_fuse experts implementation" in str(w.message)]
    for n, g in eager[3].items():
        assert families.rel_err(fused[3][n], g) < families.TOLERANCE, n


def test_opcheck_with_a_gate_up_bias():
    """Schema, fake implementation and autograd registration of the op with the bias and interleaved rows: the
    backward's fifth output is the bias gradient, empty without a bias."""
    from torch.library import opcheck

    x, ids, weights, w_gate_up, w_down = random_case(k=2)
    b_gu = biases(*w_gate_up.shape[:2], x.shape[1])[0]
    req = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    for save_h in (False, True):
        opcheck(torch.ops.moe_fuse.experts.default, (req(x), ids, req(weights), req(w_gate_up), req(w_down), save_h,
                                                      GPT_OSS.encode(), req(b_gu)))
    _, h, xs, routing, aw = torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, True)
    dy = torch.randn_like(x)
    args = (dy, x, ids, weights, w_gate_up, w_down, h, xs, routing, aw)
    interleaved = Epilogue(interleaved=True).encode()
    opcheck(torch.ops.moe_fuse.experts_backward.default, (*args, interleaved, b_gu))
    assert torch.ops.moe_fuse.experts_backward(*args, interleaved, b_gu)[4].shape == b_gu.shape
    assert torch.ops.moe_fuse.experts_backward(*args, "silu")[4].numel() == 0
