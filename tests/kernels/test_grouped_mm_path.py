"""kernels/grouped_mm_path.py (GEMMs through torch._grouped_mm, the row-ragged ones through
kernels/ragged_gemm.py unless config.ragged_gemm is off) against the float64 reference.

On CPU, torch._grouped_mm is torch's fallback and the Triton kernels (ragged GEMM, SwiGLU, dSwiGLU,
combines) run in the interpreter; on the GPU the same functions run CUTLASS. ``dispatch.grouped_mm_applies`` is False on
CPU, so the path's functions are called directly (the dispatch test pretends it is True). Rows
outside every group (expert-parallel sentinels) come back from either GEMM as NaN here: nothing may
read them. Every test runs with the ragged GEMM on and off.
"""

import os
import warnings

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from moe_fuse import config, dispatch  # noqa: E402
from support.cases import DEVICE, NAMES, make_case, poisoned_buffers, ref64, ref64_backward, rel_err  # noqa: E402
from support.paths import grouped_mm_backward, grouped_mm_forward  # noqa: E402
from moe_fuse import kernels  # noqa: E402
from moe_fuse.kernels import grouped_mm_path  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CASES = {
    # name: (T, k, E, H, I, dtype, mode)
    "uneven_fp32": (48, 4, 6, 40, 24, torch.float32, "skewed"),  # heavy experts, some empty
    "uneven_bf16": (48, 4, 6, 40, 24, torch.bfloat16, "skewed"),
    "ep_sentinels_fp32": (30, 3, 5, 40, 24, torch.float32, "sentinels"),
    "ep_sentinels_bf16": (30, 3, 5, 48, 32, torch.bfloat16, "sentinels"),
    "k1": (33, 1, 3, 40, 24, torch.float32, "uniform"),
    "all_on_one_expert": (40, 2, 5, 32, 48, torch.float32, "one"),
}


@pytest.fixture(autouse=True, params=[True, False], ids=["ragged_triton", "grouped_mm"])
def nan_outside_groups(monkeypatch, request):
    """Both GEMM routes with the rows (or, for weight gradients, nothing) outside every group set to NaN."""
    monkeypatch.setattr(config, "ragged_gemm", request.param)
    monkeypatch.setattr(config, "ragged_min_rows", 0)  # the test cases have a few hundred rows
    real = torch._grouped_mm

    def poisoned(a, b, offs=None, **kw):
        out = real(a, b, offs=offs, **kw)
        if out.dim() == 2:  # [S, N]: rows past the last group end were never computed
            out[int(offs[-1]):] = float("nan")
        return out

    real_ragged = grouped_mm_path.ragged_gemm

    def poisoned_ragged(a, b, tiles, *, b_kmajor):
        n = b.shape[1] if b_kmajor else b.shape[2]
        out = torch.full((a.shape[0], n), float("nan"), dtype=a.dtype, device=a.device)
        return real_ragged(a, b, tiles, b_kmajor=b_kmajor, out=out)  # writes every routed row, no other

    monkeypatch.setattr(torch, "_grouped_mm", poisoned)
    monkeypatch.setattr(grouped_mm_path, "ragged_gemm", poisoned_ragged)


def check(got, want, like, tol, names):
    for name, g, r, ref_like in zip(names, got, want, like):
        assert g.shape == ref_like.shape and g.dtype == ref_like.dtype, name
        assert bool(torch.isfinite(g).all()), f"{name}: a row outside every group was read"
        err = rel_err(g.cpu(), r)
        assert err < tol, f"{name}: rel. error {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_backward_match_reference(name, monkeypatch):
    T, k, E, H, I, dtype, mode = CASES[name]
    args = make_case(T, k, E, H, I, dtype, mode, seed=len(name))
    x, ids, weights, w_gate_up, w_down = args
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(7)).to(dtype).to(DEVICE)
    with poisoned_buffers(monkeypatch):
        y, h, routing, xs, aw = grouped_mm_forward(*args, save_h=True, keep_rows=True)
    check([y], [ref64(*args)], [x], TOL[dtype], ["y"])
    routed = int(routing.offsets[-1])
    assert torch.equal(xs[:routed], x[routing.token.long()][:routed])
    w = weights.reshape(-1)[routing.order.long()][:routed, None].float()
    gate, up = h[:routed].float().chunk(2, dim=1)
    torch.testing.assert_close(aw[:routed].float(), w * torch.nn.functional.silu(gate) * up,
                               **({} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}))
    want = ref64_backward(dy, *args)
    like = (x, weights, w_gate_up, w_down)
    with poisoned_buffers(monkeypatch):
        kept = grouped_mm_backward(dy, *args, h, routing=routing, xs=xs, aw=aw)
        saved_h = grouped_mm_backward(dy, *args, h)
        recomputed = grouped_mm_backward(dy, *args)
    for grads in (kept, saved_h, recomputed):
        check(grads, want, like, TOL[dtype], NAMES)
    for a, b, c in zip(kept, saved_h, recomputed):  # what the forward kept is what the backward recomputes
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("name", ["uneven_bf16", "ep_sentinels_fp32"])
def test_weights_stored_transposed(name, monkeypatch):
    """Weights stored [E, in, out] come as transposed views: the GEMMs read them in place (ragged_gemm in the
    other operand layout, torch._grouped_mm as they are), the results equal those of contiguous weights, and the
    weight gradients come in the stored layout."""
    T, k, E, H, I, dtype, mode = CASES[name]
    args = make_case(T, k, E, H, I, dtype, mode, seed=5)
    x, ids, weights, w_gate_up, w_down = args
    views = [w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w_gate_up, w_down)]
    assert all(kernels.transposed(v) for v in views)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    with poisoned_buffers(monkeypatch):
        want = grouped_mm_forward(*args, save_h=True, keep_rows=True)
        got = grouped_mm_forward(x, ids, weights, *views, save_h=True, keep_rows=True)
    routed = int(want[2].offsets[-1])
    tol = TOL[dtype] / 100  # torch's CPU fallback sums in another order for the other layout (fp32 bits differ)
    assert rel_err(got[0], want[0]) < tol and rel_err(got[1][:routed], want[1][:routed]) < tol
    g_want = grouped_mm_backward(dy, *args, want[1], routing=want[2], xs=want[3], aw=want[4])
    g_got = grouped_mm_backward(dy, x, ids, weights, *views, got[1], routing=got[2], xs=got[3], aw=got[4])
    for n, g, r in zip(NAMES, g_got, g_want):
        assert rel_err(g, r) < tol, n
    assert g_got[2].stride() == views[0].stride() and g_got[3].stride() == views[1].stride()


def test_backward_reads_the_kept_operands_and_names_bad_ones():
    """dW_down is computed from the aw handed in (not a recomputed one); a kept tensor of the wrong shape is an error."""
    T, k, E, H, I, dtype, mode = CASES["uneven_fp32"]
    args = make_case(T, k, E, H, I, dtype, mode, seed=11)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    _, h, routing, xs, aw = grouped_mm_forward(*args, save_h=True, keep_rows=True)
    base = grouped_mm_backward(dy, *args, h, routing=routing, xs=xs, aw=aw)
    doubled = grouped_mm_backward(dy, *args, h, routing=routing, xs=xs, aw=aw * 2)
    for name, a, b in zip(NAMES, base, doubled):
        if name == "d_w_down":  # dW_down = dy[tok]^T aw: twice the operand, twice the gradient
            torch.testing.assert_close(b, 2 * a)
        else:
            assert torch.equal(a, b), name
    S = T * k
    with pytest.raises(ValueError, match=rf"saved aw must be a contiguous \[S={S}, I={I}\] torch.float32 tensor, got \({S}, {2 * I}\)"):
        grouped_mm_backward(dy, *args, h, routing=routing, xs=xs, aw=h)
    with pytest.raises(ValueError, match=rf"saved rows must be a contiguous \[S={S}, H={H}\] torch.float32 tensor"):
        grouped_mm_backward(dy, *args, h, routing=routing, xs=xs[:-1], aw=aw)


def test_matches_the_triton_kernels_path():
    """Same fp32 inputs through both implementations (GEMMs in torch vs in Triton): equal to 1e-5."""
    args = make_case(40, 4, 6, 48, 32, torch.float32, "skewed", seed=3)
    dy = torch.randn(40, 48, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    y, h, _ = grouped_mm_forward(*args, save_h=True)
    y_t, h_t, _ = dispatch.experts_forward(*args, save_h=True)
    assert rel_err(y, y_t) < 1e-5 and rel_err(h, h_t) < 1e-5
    for a, b in zip(grouped_mm_backward(dy, *args, h), dispatch.experts_backward(dy, *args, h_t)):
        assert rel_err(a, b) < 1e-5


def test_combine_sorted_skips_sentinel_slots():
    from moe_fuse.kernels.permute import combine_sorted

    rows = torch.randn(6, 8)
    pos = torch.tensor([[0, 5], [1, 2], [3, 4]], dtype=torch.int32)
    ids = torch.tensor([[0, 9], [1, 1], [9, 2]])  # 9 >= E = 3: a sentinel slot
    w = torch.rand(3, 2)
    rows[5] = float("nan")  # the sentinel slots' rows
    rows[3] = float("nan")
    y = combine_sorted(rows.to(DEVICE), pos.to(DEVICE), w.to(DEVICE), torch.float32, ids=ids.to(DEVICE), num_experts=3)
    want = torch.stack([w[0, 0] * rows[0], w[1, 0] * rows[1] + w[1, 1] * rows[2], w[2, 1] * rows[4]])
    torch.testing.assert_close(y.cpu(), want)


def test_dispatch_takes_the_path_for_training_only(monkeypatch):
    """dispatch.experts_forward takes the path when h is kept for the backward; the backward always where it applies."""
    calls = []
    for name in ("experts_forward", "experts_backward"):
        real = getattr(grouped_mm_path, name)
        monkeypatch.setattr(grouped_mm_path, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    monkeypatch.setattr(dispatch, "grouped_mm_applies", lambda *a: True)
    args = make_case(12, 2, 4, 16, 8, torch.float32, seed=5)
    dy = torch.randn(12, 16).to(DEVICE)
    dispatch.experts_forward(*args)
    assert calls == []  # inference / checkpointed layers: the fused Triton forward, no h in memory
    _, h, routing, xs, aw = dispatch.experts_forward(*args, save_h=True, keep_rows=True)
    assert xs.shape == (12 * 2, 16) and aw.shape == (12 * 2, 8)
    dispatch.experts_backward(dy, *args, h, routing=routing, xs=xs, aw=aw)
    dispatch.experts_backward(dy, *args)
    assert calls == ["experts_forward", "experts_backward", "experts_backward"]
    empty = [t[:0] for t in args[:3]] + args[3:]
    assert dispatch.experts_forward(*empty, save_h=True, keep_rows=True)[3:] == (None, None)  # S = 0: the Triton path
    assert len(calls) == 3


def test_dispatch_of_weights_stored_transposed(monkeypatch):
    """With weights stored transposed the forward without h takes the path too (the fused Triton forward would
    read them through pointer loads), with the same y as the Triton kernels on contiguous weights."""
    calls = []
    real = grouped_mm_path.experts_forward
    monkeypatch.setattr(grouped_mm_path, "experts_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(dispatch, "grouped_mm_applies", lambda *a: True)
    x, ids, weights, w_gate_up, w_down = make_case(12, 2, 4, 16, 8, torch.float32, seed=6)
    views = [w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w_gate_up, w_down)]
    want = dispatch.experts_forward(x, ids, weights, w_gate_up, w_down)
    assert calls == []
    got = dispatch.experts_forward(x, ids, weights, *views)
    assert calls == [1] and rel_err(got, want) < 1e-6


def test_ragged_gemm_from_min_rows_up(monkeypatch):
    """The row-ragged GEMMs go through ragged_gemm from RAGGED_MIN_ROWS routed rows up, else through torch."""
    args = make_case(12, 2, 4, 16, 8, torch.float32, seed=5)
    dy = torch.randn(12, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    monkeypatch.setattr(config, "ragged_gemm", True)  # whatever the fixture chose
    calls = []
    real = grouped_mm_path.ragged_gemm
    monkeypatch.setattr(grouped_mm_path, "ragged_gemm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for min_rows, want in ((24, 4), (25, 0)):  # 12 tokens x k=2 = 24 rows
        monkeypatch.setattr(config, "ragged_min_rows", min_rows)
        calls.clear()
        _, h, routing, xs, aw = grouped_mm_forward(*args, save_h=True, keep_rows=True)
        grouped_mm_backward(dy, *args, h, routing=routing, xs=xs, aw=aw)
        assert len(calls) == want, (min_rows, len(calls))


def test_inference_rule_follows_the_routing_weights_dtype_and_the_expert_width(monkeypatch):
    """The forward without h takes grouped_mm_path when the routing weights are wider than x (the fused forward
    would keep the k slots in that dtype) or the experts are config.inference_min_width wide or more;
    config.inference_grouped_mm forces either way."""
    x16, x32 = torch.empty(2, 4, dtype=torch.bfloat16), torch.empty(2, 4)
    w16, w32 = torch.empty(2, 2, dtype=torch.bfloat16), torch.empty(2, 2)
    wide = config.inference_min_width
    narrow_down, wide_down = torch.empty(2, 4, wide - 8, device="meta"), torch.empty(2, 4, wide, device="meta")
    assert config.inference_grouped_mm is None
    assert dispatch.inference_on_grouped_mm(x16, w32, narrow_down)
    assert not dispatch.inference_on_grouped_mm(x16, w16, narrow_down)
    assert not dispatch.inference_on_grouped_mm(x32, w32, narrow_down)
    assert dispatch.inference_on_grouped_mm(x16, w16, wide_down)
    monkeypatch.setattr(config, "inference_grouped_mm", False)
    assert not dispatch.inference_on_grouped_mm(x16, w32, wide_down)
    monkeypatch.setattr(config, "inference_grouped_mm", True)
    assert dispatch.inference_on_grouped_mm(x32, w32, narrow_down)


def test_inference_switch_sends_the_forward_without_h_to_the_path(monkeypatch):
    """config.inference_grouped_mm = True (a bench A/B switch): the forward without h takes grouped_mm_path
    even with weights in x's dtype, with the same y as the fused Triton forward's within rounding."""
    calls = []
    real = grouped_mm_path.experts_forward
    monkeypatch.setattr(grouped_mm_path, "experts_forward", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setattr(dispatch, "grouped_mm_applies", lambda *a: True)
    args = make_case(12, 2, 4, 16, 8, torch.float32, seed=6)
    fused = dispatch.experts_forward(*args)
    assert calls == [] and config.inference_grouped_mm is None
    monkeypatch.setattr(config, "inference_grouped_mm", True)
    y = dispatch.experts_forward(*args)
    assert len(calls) == 1 and calls[0]["save_h"] is False
    check([y, fused], [ref64(*args)] * 2, [args[0]] * 2, TOL[torch.float32], ["path", "fused"])


@pytest.mark.parametrize("save_h, keep_rows", [(False, False), (True, False), (True, True)])
def test_forward_drops_what_it_does_not_return_once_read(save_h, keep_rows, monkeypatch):
    """The sorted rows of x are no longer referenced when the activation pass runs, nor h (without save_h) when
    the down GEMM runs: the forward without h never holds xs, h and aw at once. With keep_rows xs is returned,
    so still alive."""
    import weakref

    refs, seen, at_act = {}, [], []
    real_expand, real_gemm, real_act = grouped_mm_path.expand_rows, grouped_mm_path._row_gemm, grouped_mm_path.swiglu

    def act(*a, **kw):
        at_act.append(refs["xs"]() is not None)
        return real_act(*a, **kw)

    def expand(*a, **kw):
        out = real_expand(*a, **kw)
        refs["xs"] = weakref.ref(out)
        return out

    def gemm(a, *rest, **kw):
        if len(seen) == 1:  # the down GEMM: a is aw
            seen.append({name: r() is not None for name, r in refs.items()})
        out = real_gemm(a, *rest, **kw)
        if not seen:
            refs["h"] = weakref.ref(out)
            seen.append("gate_up")
        return out

    monkeypatch.setattr(grouped_mm_path, "expand_rows", expand)
    monkeypatch.setattr(grouped_mm_path, "_row_gemm", gemm)
    monkeypatch.setattr(grouped_mm_path, "swiglu", act)
    args = make_case(24, 2, 4, 16, 8, torch.float32, seed=7)
    out = grouped_mm_forward(*args, save_h=save_h, keep_rows=keep_rows)
    assert at_act == [save_h and keep_rows]
    assert seen[1] == {"xs": save_h and keep_rows, "h": save_h}
    y = out[0] if save_h else out
    assert rel_err(y, ref64(*args)) < TOL[torch.float32]
