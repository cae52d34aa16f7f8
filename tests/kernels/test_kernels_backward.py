"""The Triton backward kernels of the experts block against the float64 reference.

``reference.experts_backward`` on float64 copies of the inputs is the contract
(test_ops.py checks it against autograd). Runs in the Triton interpreter on CPU
tensors when no GPU is present; shapes stay tiny (see test_kernels_forward.py).
Tolerances are relative norms: bf16 is loose because d_h and aw are stored in the
weights' dtype and the interpreter rounds to bf16 by truncation.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from moe_fuse import kernels  # noqa: E402
from moe_fuse.dispatch import experts_backward, experts_forward  # noqa: E402
from moe_fuse.kernels.backward import BackwardConfig, GemmConfig  # noqa: E402
from moe_fuse.kernels.backward import experts_backward as backward_with_config  # noqa: E402
from support.cases import DEVICE, NAMES, make_case, poisoned_buffers, rel_err  # noqa: E402
from support.cases import ref64_backward as ref64  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def check(args, dy, monkeypatch, tol, config=None, saved_h=False):
    """``saved_h``: the backward reads the pre-activation the forward kept instead of recomputing it."""
    x, ids, weights, w_gate_up, w_down = args
    h = experts_forward(*args, save_h=True)[1] if saved_h else None
    with poisoned_buffers(monkeypatch):
        if config is None:
            grads = experts_backward(dy, *args, h)
        else:
            grads = backward_with_config(dy, *args, h, config=config)
    want = ref64(dy, *args)
    for name, g, r, like in zip(NAMES, grads, want, (x, weights, w_gate_up, w_down)):
        assert g.shape == like.shape and g.dtype == like.dtype, name
        # contiguous, except a weight's gradient, which comes in that weight's layout where it is stored transposed
        layout_of = like if name.startswith("d_w_") and kernels.transposed(like) else g.contiguous()
        assert g.stride() == layout_of.stride(), name
        assert bool(torch.isfinite(g).all()), f"{name}: some element was never written"
        if r.norm() == 0:
            assert bool((g == 0).all()), name
        else:
            err = rel_err(g.cpu(), r)
            assert err < tol, f"{name}: rel. error {err:.2e} >= {tol:.0e}"
    return grads


BACKWARD_CASES = {
    # name: (T, k, E, H, I, dtype, mode, extra)
    "uneven_bf16": (48, 4, 6, 40, 24, torch.bfloat16, "skewed", {}),  # heavy experts, some empty
    "uneven_fp16": (48, 4, 6, 40, 24, torch.float16, "skewed", {}),
    "uneven_fp32": (48, 4, 6, 40, 24, torch.float32, "skewed", {}),
    "empty_experts": (30, 2, 8, 48, 40, torch.float16, "two", {}),
    "all_on_one_expert": (40, 2, 5, 32, 48, torch.float32, "one", {}),  # 80 rows: several M-tiles, long K in wgrad
    "single_token": (1, 2, 4, 40, 24, torch.bfloat16, "uniform", {}),
    "k1": (33, 1, 3, 40, 24, torch.float32, "uniform", {}),
    "k_equals_E": (12, 5, 5, 24, 40, torch.float16, "uniform", {}),
    "even_blocks": (16, 2, 4, 64, 32, torch.bfloat16, "uniform", {}),  # H, I multiples of the blocks
    "odd_sizes_E7": (21, 3, 7, 72, 56, torch.float32, "uniform", {}),  # tails in M, N and K everywhere
    "ep_sentinels": (30, 3, 5, 40, 24, torch.float32, "sentinels", {}),
    "x_fp32_weights_bf16": (24, 2, 4, 40, 24, torch.float32, "uniform", {"w_dtype": torch.bfloat16}),
    "routing_fp32_x_bf16": (24, 2, 4, 40, 24, torch.bfloat16, "uniform", {"r_dtype": torch.float32}),
}


@pytest.mark.parametrize("saved_h", [False, True], ids=["recompute_h", "saved_h"])
@pytest.mark.parametrize("name", list(BACKWARD_CASES))
def test_backward_matches_reference(name, saved_h, monkeypatch):
    T, k, E, H, I, dtype, mode, extra = BACKWARD_CASES[name]
    args = make_case(T, k, E, H, I, dtype, mode, seed=len(name), **extra)
    gen = torch.Generator().manual_seed(len(name) + 1)
    dy = torch.randn(T, H, generator=gen).to(dtype).to(DEVICE)
    tol = max(TOL[dtype], TOL[args[3].dtype], TOL[args[2].dtype])
    if saved_h:
        # h is kept in the weights' dtype (as torch's grouped_mm path keeps it): one more rounding of every
        # element the dSwiGLU reads; the interpreter's truncating bf16 cast makes it about 1.5x the error.
        tol *= 1.5
    check(args, dy, monkeypatch, tol, saved_h=saved_h)


def test_stride0_dy(monkeypatch):
    """The gradient of y.sum() arrives as a stride-0 expand."""
    args = make_case(20, 3, 5, 40, 24, torch.float32, "skewed", seed=3)
    dy = torch.ones(1, 1, device=DEVICE).expand(20, 40)
    assert dy.stride() == (0, 0)
    check(args, dy, monkeypatch, TOL[torch.float32])


def test_non_contiguous_inputs(monkeypatch):
    x, ids, weights, w_gate_up, w_down = make_case(20, 3, 6, 40, 24, torch.float32, "skewed", seed=7)
    x_nc = torch.empty(20, 80, device=DEVICE)[:, ::2]
    x_nc.copy_(x)
    dy = torch.randn(40, 20, device=DEVICE).t()  # transposed storage
    args = (x_nc, ids.t().contiguous().t(), weights.t().contiguous().t(),
            w_gate_up.transpose(1, 2).contiguous().transpose(1, 2), w_down.transpose(1, 2).contiguous().transpose(1, 2))
    assert not any(t.is_contiguous() for t in (dy, *args))
    check(args, dy, monkeypatch, TOL[torch.float32])


def test_all_slots_off_rank(monkeypatch):
    """Expert parallelism with no local rows: every gradient is zero, and written."""
    args = make_case(10, 2, 4, 40, 24, torch.float32, seed=9)
    args[1] = args[1] + 4
    check(args, torch.randn(10, 40, device=DEVICE), monkeypatch, TOL[torch.float32])


@pytest.mark.parametrize(
    "dtype, mode, saved_h",
    [
        (torch.float32, "skewed", False),
        (torch.bfloat16, "skewed", False),
        (torch.bfloat16, "skewed", True),
        (torch.float32, "sentinels", True),
    ],
)
def test_tma_descriptor_path(dtype, mode, saved_h, monkeypatch):
    """The Hopper path (weights, and d_h in the dx GEMM, through tensor descriptors), run by the interpreter.

    I = 24 < BLOCK_N: gate tiles run into the up rows, the last expert's tiles past the tensor's end;
    H = 40 is not a multiple of BLOCK_K: the W_down K tail reads the next expert's rows.
    """
    args = make_case(26, 3, 5, 40, 24, dtype, mode, seed=5)
    tma = GemmConfig(16, 32, 32, 1, 4, 1, use_tma=True)
    cfg = BackwardConfig(tma, tma, GemmConfig(32, 32, 16, 1, 4, 1))
    dy = torch.randn(26, 40, device=DEVICE).to(dtype)
    check(args, dy, monkeypatch, TOL[dtype] * (1.5 if saved_h else 1), config=cfg, saved_h=saved_h)


def test_deterministic():
    args = make_case(24, 3, 6, 40, 24, torch.bfloat16, "skewed", seed=11)
    dy = torch.randn(24, 40, device=DEVICE).to(torch.bfloat16)
    _, h, routing = experts_forward(*args, save_h=True)
    for saved in (None, h):
        first = experts_backward(dy, *args, saved)
        second = experts_backward(dy, *args, saved)
        for name, a, b in zip(NAMES, first, second):
            assert torch.equal(a, b), name
    # The forward's routing, kept: the same gradients as routing again.
    for name, a, b in zip(NAMES, experts_backward(dy, *args, h, routing=routing), first):
        assert torch.equal(a, b), name


def test_bad_saved_h_is_named():
    args = make_case(6, 2, 4, 16, 8, torch.float32)
    h = experts_forward(*args, save_h=True)[1]
    with pytest.raises(ValueError, match=r"saved h must be a contiguous \[S=12, 2I=16\] torch.float32 tensor"):
        experts_backward(torch.randn(6, 16, device=DEVICE), *args, h[:-1])


def test_empty_batch():
    x, ids, weights, w_gate_up, w_down = make_case(3, 2, 4, 16, 16, torch.float32)
    dx, dw, d_wgu, d_wd = experts_backward(x[:0], x[:0], ids[:0], weights[:0], w_gate_up, w_down)
    assert dx.shape == (0, 16) and dw.shape == (0, 2)
    assert bool((d_wgu == 0).all()) and bool((d_wd == 0).all())
