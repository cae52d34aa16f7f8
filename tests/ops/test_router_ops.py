"""The router ops of moe_fuse/router_ops.py: explicit backward formulas against float64 autograd,
the registered ops against autograd through the same math (fp32, bf16), and opcheck."""

import pytest
import torch

import moe_fuse.ops  # noqa: F401  (registers torch.ops.moe_fuse.router)
from moe_fuse import reference
from moe_fuse import router_ops as R

T, H, E = 7, 12, 8


def _inputs(dtype, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    w = (torch.randn(E, H, generator=gen) * 0.5).to(dtype)
    b = (torch.randn(E, generator=gen) * 0.3).to(dtype) if bias else None
    return x, w, b


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _autograd(forward, x, w, b, d_logits, d_weights):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
    logits, weights, ids = forward(*leaves)
    outs = [o for o in (logits, weights) if o.requires_grad]
    grads = torch.autograd.grad(outs, [t for t in leaves if t is not None],
                                [d_logits, d_weights][: len(outs)], allow_unused=True)
    return logits.detach(), weights.detach(), ids, grads


SIGMOID_CASES = [  # n_group, topk_group, renorm, eps, scale
    (1, 1, True, 1e-20, 2.5),
    (4, 2, True, 1e-20, 2.5),
    (4, 2, False, 0.0, 1.0),
    (2, 1, True, 0.0, 1.0),
]


@pytest.mark.parametrize("n_group,topk_group,renorm,eps,scale", SIGMOID_CASES)
def test_sigmoid_backward_formula(n_group, topk_group, renorm, eps, scale):
    x, w, b = _inputs(torch.float64)

    def forward(x, w, b):
        return R.sigmoid_forward(x, w, b, 3, n_group, topk_group, False, False, renorm, eps, scale, "native",
                                 torch.float64)

    gen = torch.Generator().manual_seed(5)
    d_logits, d_weights = torch.randn(T, E, generator=gen).double(), torch.randn(T, 3, generator=gen).double()
    logits, _, ids, (dx, dw, db) = _autograd(forward, x, w, b, d_logits, d_weights)
    assert db is None  # the bias only steers the selection
    got_dx, got_dw = R.sigmoid_backward(d_logits, d_weights, x, w, logits, ids, renorm, eps, scale, "native")
    assert _rel(got_dx, dx) < 1e-12 and _rel(got_dw, dw) < 1e-12


def test_sigmoid_groups_limit_the_choice():
    x, w, b = _inputs(torch.float32)
    for sorted_ in (False, True):  # 4 groups of 2 experts, 1 group kept: both picks in it
        _, _, ids = R.sigmoid_forward(x, w, b, 2, 4, 1, False, sorted_, True, 1e-20, 1.0, "fp32_inputs", torch.float32)
        assert (ids // 2 == ids[:, :1] // 2).all() and (ids[:, 0] != ids[:, 1]).all()
    _, _, free = R.sigmoid_forward(x, w, b, 2, 1, 1, False, True, True, 1e-20, 1.0, "fp32_inputs", torch.float32)
    assert not (free // 2 == free[:, :1] // 2).all()  # without groups these inputs pick across groups


@pytest.mark.parametrize("divisor", [1.0, 2.0])
@pytest.mark.parametrize("bias", [True, False])
def test_topk_softmax_backward_formula(divisor, bias):
    x, w, b = _inputs(torch.float64, bias=bias)

    def forward(x, w, b):
        return R.topk_softmax_forward(x, w, b, 3, "native", torch.float64, divisor, torch.float64)

    gen = torch.Generator().manual_seed(5)
    d_logits, d_weights = torch.randn(T, E, generator=gen).double(), torch.randn(T, 3, generator=gen).double()
    logits, _, ids, grads = _autograd(forward, x, w, b, d_logits, d_weights)
    got = R.topk_softmax_backward(d_logits, d_weights, x, w, b, logits, ids, torch.float64, divisor, "native")
    for g, want in zip(got, grads):
        assert (g is None) == (want is None)
        if want is not None:
            assert _rel(g, want) < 1e-12


@pytest.mark.parametrize("dtype,mode", [(torch.float32, "fp32_inputs"), (torch.bfloat16, "fp32_inputs"),
                                        (torch.bfloat16, "fp32_output")])
def test_router_sigmoid_op_matches_autograd(dtype, mode):
    x, w, b = _inputs(dtype)
    b = b.float()
    args = (4, 2, False, False, True, 1e-20, 2.5, mode, torch.float32)

    def forward(x, w, b):
        return R.sigmoid_forward(x, w, b, 3, *args)

    def fused(x, w, b):
        return torch.ops.moe_fuse.router_sigmoid(x, w, b, 3, *args)

    gen = torch.Generator().manual_seed(5)
    d_logits, d_weights = torch.randn(T, E, generator=gen), torch.randn(T, 3, generator=gen)
    want = _autograd(forward, x, w, b, d_logits, d_weights)
    got = _autograd(fused, x, w, b, d_logits, d_weights)
    assert torch.equal(got[2], want[2]) and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got[3][2] is None and want[3][2] is None
    for g, wnt in zip(got[3][:2], want[3][:2]):
        assert g.dtype == wnt.dtype and _rel(g, wnt) < tol


@pytest.mark.parametrize("dtype,mode,bias", [(torch.float32, "native", True), (torch.bfloat16, "native", True),
                                             (torch.bfloat16, "fp32_output", False),
                                             (torch.bfloat16, "fp32_inputs", True)])
def test_router_topk_softmax_op_matches_autograd(dtype, mode, bias):
    x, w, b = _inputs(dtype, bias=bias)
    sdt = torch.float32 if mode != "native" else dtype
    args = (mode, sdt, 2.0, dtype)

    def forward(x, w, b):
        return R.topk_softmax_forward(x, w, b, 3, *args)

    def fused(x, w, b):
        return torch.ops.moe_fuse.router_topk_softmax(x, w, b, 3, *args)

    gen = torch.Generator().manual_seed(5)
    logits_dtype = dtype if mode == "native" else torch.float32
    d_logits, d_weights = torch.randn(T, E, generator=gen).to(logits_dtype), torch.randn(T, 3, generator=gen).to(dtype)
    want = _autograd(forward, x, w, b, d_logits, d_weights)
    got = _autograd(fused, x, w, b, d_logits, d_weights)
    for g, wnt in zip(got[:3], want[:3]):
        assert torch.equal(g, wnt)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, wnt in zip(got[3], want[3]):
        assert (g is None) == (wnt is None)
        if wnt is not None:
            assert g.dtype == wnt.dtype and _rel(g, wnt) < tol


def test_opcheck():
    x, w, b = _inputs(torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    torch.library.opcheck(torch.ops.moe_fuse.router_sigmoid.default,
                          (x, w, b, 3, 4, 2, False, False, True, 1e-20, 2.5, "fp32_inputs", torch.float32))
    torch.library.opcheck(torch.ops.moe_fuse.router_topk_softmax.default,
                          (x, w, b.requires_grad_(), 3, "native", torch.float32, 1.0, torch.float32))
    torch.library.opcheck(torch.ops.moe_fuse.router_topk_softmax.default,
                          (x, w, None, 3, "fp32_output", torch.float32, 2.0, torch.float32))


def _non_finite_inputs(dtype):
    """x with a NaN row (1); a +inf router weight gives expert 3 a +inf logit on row 2 (x[2, 0] > 0), NaN on row 3
    (x[3, 0] = 0) and -inf on the others (x[:, 0] < 0: sigmoid 0, softmax probability 0)."""
    x, w, b = _inputs(dtype)
    x[1] = float("nan")
    x[:, 0] = -x[:, 0].abs() - 0.1
    x[2:4, 0] = torch.tensor([1.0, 0.0], dtype=dtype)
    w[3, 0] = float("inf")
    return x, w, b


@pytest.mark.parametrize("router", ["sigmoid", "sigmoid_grouped", "topk_softmax"])
def test_non_finite_logits_as_autograd(router):
    """NaN and inf logits: the op's outputs are eager's bits (NaN at the same places, ids in [0, E)), and its
    written-out backward has NaN where autograd through the eager math has it, and autograd's values elsewhere."""
    x, w, b = _non_finite_inputs(torch.float64)
    if router == "topk_softmax":
        args = ("native", torch.float64, 1.0, torch.float64)
        eager = lambda x, w, b: R.topk_softmax_forward(x, w, b, 3, *args)  # noqa: E731
        op = lambda x, w, b: torch.ops.moe_fuse.router_topk_softmax(x, w, b, 3, *args)  # noqa: E731
    else:
        groups = (4, 2) if router == "sigmoid_grouped" else (1, 1)
        args = (*groups, False, True, True, 1e-20, 2.5, "native", torch.float64)
        eager = lambda x, w, b: R.sigmoid_forward(x, w, b, 3, *args)  # noqa: E731
        op = lambda x, w, b: torch.ops.moe_fuse.router_sigmoid(x, w, b, 3, *args)  # noqa: E731
    gen = torch.Generator().manual_seed(9)
    d_logits, d_weights = torch.randn(T, E, generator=gen).double(), torch.randn(T, 3, generator=gen).double()
    want = _autograd(eager, x, w, b, d_logits, d_weights)
    got = _autograd(op, x, w, b, d_logits, d_weights)
    assert bool(((got[2] >= 0) & (got[2] < E)).all())
    assert bool(got[1][1].isnan().all())  # the NaN row
    for g, wnt in zip(got[:3], want[:3]):
        torch.testing.assert_close(g, wnt, rtol=0, atol=0, equal_nan=True)
    for g, wnt in zip(got[3], want[3]):
        assert (g is None) == (wnt is None)
        if wnt is not None:
            assert torch.equal(g.isnan(), wnt.isnan())
            torch.testing.assert_close(g, wnt, rtol=1e-10, atol=1e-10, equal_nan=True)


def test_softmax_router_reference_backward_non_finite_as_autograd():
    """The softmax router's torch path (CPU; reference.router_backward) on NaN and inf logits against autograd."""
    x, w, _ = _non_finite_inputs(torch.float64)
    gen = torch.Generator().manual_seed(10)
    d_logits, d_weights = torch.randn(T, E, generator=gen).double(), torch.randn(T, 3, generator=gen).double()
    for renorm in (True, False):
        logits, weights, ids, grads = _autograd(
            lambda x, w, b: reference.router_forward(x, w, 3, renorm, torch.float64), x, w, None, d_logits, d_weights)
        got_l, got_w, got_ids = torch.ops.moe_fuse.router(x, w, 3, renorm, torch.float64)
        assert torch.equal(got_ids, ids) and bool(((ids >= 0) & (ids < E)).all())
        torch.testing.assert_close(got_w, weights, rtol=0, atol=0, equal_nan=True)
        dx, dw = reference.router_backward(d_logits, d_weights, x, w, logits, ids, renorm)
        for g, wnt in zip((dx, dw), grads):
            assert torch.equal(g.isnan(), wnt.isnan())
            torch.testing.assert_close(g, wnt, rtol=1e-5, atol=1e-6, equal_nan=True)  # its softmax is fp32
