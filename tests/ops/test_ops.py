"""The fused custom ops: math against a naive float64 definition, opcheck, errors."""

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import moe_fuse.ops  # noqa: F401  (registers torch.ops.moe_fuse)
from support.cases import random_case


def naive_experts(x, ids, weights, w_gate_up, w_down):
    """The definition, one (token, slot) at a time; sentinel ids >= E add nothing."""
    E = w_gate_up.shape[0]
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= E:
                continue
            gate, up = (w_gate_up[e] @ x[t]).chunk(2)
            acc = acc + weights[t, j] * (w_down[e] @ (F.silu(gate) * up))
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("save_h", [False, True])
@pytest.mark.parametrize("sentinel_fraction", [0.0, 0.3])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_experts_forward_and_backward_match_definition(k, sentinel_fraction, save_h):
    x, ids, weights, w_gate_up, w_down = random_case(k=k, sentinel_fraction=sentinel_fraction)
    leaves = [t.requires_grad_() for t in (x, weights, w_gate_up, w_down)]
    want = naive_experts(x, ids, weights, w_gate_up, w_down)
    got, h, xs, routing, aw = torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, save_h)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # The reference (CPU) keeps h alone: the sorted rows, the routing and aw are the CUDA kernels'.
    assert xs.shape == (0, x.shape[1]) and routing.shape == (0,) and routing.dtype == torch.int32
    assert aw.shape == (0, w_down.shape[2]) and aw.dtype == w_down.dtype
    if save_h:  # the pre-activation of each routed row, in expert order (sentinel rows zero)
        order = torch.argsort(ids.reshape(-1), stable=True)
        routed = (ids.reshape(-1) < w_gate_up.shape[0])[order]
        want_h = torch.einsum("sh,sjh->sj", x[order // k], w_gate_up[ids.reshape(-1)[order].clamp(max=w_gate_up.shape[0] - 1)])
        torch.testing.assert_close(h[routed], want_h[routed])
        assert not h[~routed].any()
    else:
        assert h.shape == (0, w_gate_up.shape[1])
    dy = torch.randn_like(want)
    for g_got, g_want in zip(torch.autograd.grad(got, leaves, dy), torch.autograd.grad(want, leaves, dy)):
        torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-10)


def test_experts_all_tokens_on_one_expert_and_empty_experts():
    x, ids, weights, w_gate_up, w_down = random_case(k=1)
    ids.fill_(3)
    got = torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down)[0]
    torch.testing.assert_close(got, naive_experts(x, ids, weights, w_gate_up, w_down))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # the reference; the Triton kernels
def test_experts_of_weights_stored_transposed(dtype):
    """Weights stored [E, in, out] (Aria, GPT-OSS) reach the op as transposed views: the same output and
    gradients as contiguous copies, and weight gradients in the stored layout, so that the gradient of the view
    lands on the parameter without a copy; opcheck compares the fake implementation's strides with the real."""
    x, ids, weights, w_gate_up, w_down = (t.to(dtype) if t.is_floating_point() else t for t in random_case(k=2))
    stored = [w.transpose(1, 2).contiguous().requires_grad_() for w in (w_gate_up, w_down)]
    views = [w.transpose(1, 2) for w in stored]
    assert not views[0].is_contiguous()
    leaves = [t.requires_grad_() for t in (x, weights, w_gate_up, w_down)]
    tol = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    want = torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, True)
    got = torch.ops.moe_fuse.experts(x, ids, weights, *views, True)
    torch.testing.assert_close(got[0], want[0], **tol)
    dy = torch.randn_like(want[0])
    g_want = torch.autograd.grad(want[0], leaves, dy)
    g_got = torch.autograd.grad(got[0], [x, weights, *stored], dy)
    for name, g, r in zip(("dx", "d_weights", "d_w_gate_up", "d_w_down"), g_got, g_want):
        if g.dim() == 3:
            assert g.is_contiguous(), name  # [E, in, out], as stored
            g = g.transpose(1, 2)
        torch.testing.assert_close(g, r, **tol, msg=name)
    args = [*(t.detach() for t in (dy, x, ids, weights, *views, *got[1:])), "silu"]
    d_wgu, d_wd = torch.ops.moe_fuse.experts_backward(*args)[2:4]
    assert d_wgu.stride() == views[0].stride() and d_wd.stride() == views[1].stride()
    opcheck(torch.ops.moe_fuse.experts_backward.default, tuple(args))


def test_weight_gradient_in_its_layout_is_returned_as_is():
    """A weight gradient the kernels already wrote in the weight's layout is handed back itself (no copy, nothing
    allocated: an empty weight-sized tensor per backward once raised the layer's peak by ~0.6 GB); another is
    copied into that layout."""
    from moe_fuse.ops import in_layout_of

    w = torch.randn(3, 8, 5)
    stored_t = torch.randn(3, 5, 8).transpose(1, 2)
    for weight in (w, stored_t):
        g = torch.empty_like(weight)  # the same strides
        assert in_layout_of(g, weight) is g
    g = torch.randn(3, 8, 5)
    moved = in_layout_of(g, stored_t)
    assert moved.stride() == stored_t.stride() and torch.equal(moved, g)


@pytest.mark.parametrize("renorm", [True, False])
def test_router_matches_definition(renorm):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(11, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    logits = F.linear(x, w)
    values, ids = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), 3, dim=-1)
    if renorm:
        values = values / values.sum(-1, keepdim=True)
    logits2, weights2, ids2 = torch.ops.moe_fuse.router(x, w, 3, renorm, torch.float64)
    assert torch.equal(ids2, ids)
    torch.testing.assert_close(weights2, values.double())
    d_logits, d_weights = torch.randn_like(logits), torch.randn_like(weights2)
    want = torch.autograd.grad((logits * d_logits).sum() + (values * d_weights).sum(), (x, w))
    got = torch.autograd.grad((logits2 * d_logits).sum() + (weights2 * d_weights).sum(), (x, w))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)  # the softmax runs in fp32


def test_router_backward_gets_none_for_unused_logits(monkeypatch):
    """Only the routing weights carry a gradient: the backward op is called with d_logits None (no zero
    [T, E] tensor filled and read), and the gradients equal those with an explicit zero d_logits."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(11, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    d_weights = torch.randn(11, 3, generator=gen, dtype=torch.float64)
    seen = []
    real = moe_fuse.ops.router_backward

    def spy(d_logits, *args):
        seen.append(d_logits)
        return real(d_logits, *args)

    monkeypatch.setattr(torch.ops.moe_fuse, "router_backward", spy, raising=False)
    logits, weights, _ = torch.ops.moe_fuse.router(x, w, 3, True, torch.float64)
    got = torch.autograd.grad((weights * d_weights).sum(), (x, w))
    assert len(seen) == 1 and seen[0] is None
    logits, weights, _ = torch.ops.moe_fuse.router(x, w, 3, True, torch.float64)
    want = torch.autograd.grad((weights * d_weights).sum() + (logits * 0).sum(), (x, w))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    x, ids, weights, w_gate_up, w_down = (t.to(dtype) if t.is_floating_point() else t for t in random_case())
    req = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    for save_h in (False, True):
        opcheck(torch.ops.moe_fuse.experts.default, (req(x), ids, req(weights), req(w_gate_up), req(w_down), save_h))
    dy = torch.randn_like(x)
    _, h, xs, routing, aw = torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, True)
    for saved in (h, h[:0]):
        args = (dy, x, ids, weights, w_gate_up, w_down, saved, xs, routing, aw, "silu")
        opcheck(torch.ops.moe_fuse.experts_backward.default, args)
    w_router = torch.randn(5, x.shape[1], dtype=dtype)
    opcheck(torch.ops.moe_fuse.router.default, (req(x), req(w_router), 2, True, dtype))
    logits, _, r_ids = torch.ops.moe_fuse.router(x, w_router, 2, True, dtype)
    for d_logits in (torch.randn_like(logits), None):  # None: no gradient reached the logits output
        opcheck(
            torch.ops.moe_fuse.router_backward.default,
            (d_logits, torch.randn(r_ids.shape, dtype=dtype), x, w_router, logits, r_ids, True),
        )


def test_bad_shapes_are_named():
    x, ids, weights, w_gate_up, w_down = random_case()
    with pytest.raises(ValueError, match=r"ids \(9, 2\) and weights \(9, 3\)"):
        torch.ops.moe_fuse.experts(x, ids, weights[:, [0, 1, 1]], w_gate_up, w_down)
    with pytest.raises(ValueError, match="gate_up \\[E, 2I, H\\] and down \\[E, H, I\\]"):
        torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down.transpose(1, 2))


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_an_epilogue_string_that_is_none_is_named(fake):
    """The op decodes its epilogue string (spec.Epilogue): what is not one is a ValueError naming the op and the
    string, in the real and the fake implementation alike, in the forward and the backward ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = random_case()
    x, ids, weights, w_gate_up, w_down = args
    _, h, xs, routing, aw = torch.ops.moe_fuse.experts(*args, True)
    backward = (torch.randn_like(x), *args, h, xs, routing, aw)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.autograd.grad_mode.no_grad()
    with mode:
        with pytest.raises(ValueError, match=r"moe_fuse.experts: epilogue 'silu\(' is not an Epilogue encoding"):
            torch.ops.moe_fuse.experts(*args, False, "silu(")
        with pytest.raises(ValueError, match=r"moe_fuse.experts: epilogue 'silu\(swiglu_limit=7\)' is not in "
                                             r"canonical form; it is written 'silu\(swiglu_limit=7.0\)'"):
            torch.ops.moe_fuse.experts(*args, True, "silu(swiglu_limit=7)")
        with pytest.raises(ValueError, match=r"moe_fuse.experts_backward: epilogue 'swiglu': activation must be one"):
            torch.ops.moe_fuse.experts_backward(*backward, "swiglu")
        with pytest.raises(ValueError, match=r"moe_fuse.experts_backward_down: epilogue 'silu\(limit=1.0\)': "):
            torch.ops.moe_fuse.experts_backward_down(*backward[:7], routing, aw, "silu(limit=1.0)")
        y = torch.ops.moe_fuse.experts(*args, False, "silu(swiglu_limit=7.0)")[0]  # a canonical one runs
        assert y.shape == x.shape


def test_the_epilogue_reaches_the_reference():
    """Each field of the op's epilogue string changes the result as the reference's keyword arguments do."""
    from moe_fuse import reference
    from moe_fuse.spec import Epilogue

    args = random_case(k=2)
    for epilogue in (Epilogue(), Epilogue(swiglu_limit=0.5, glu_alpha=1.702, interleaved=True),
                     Epilogue("gelu_tanh", interleaved=True), Epilogue("softcapped_silu", 0.5, 0.8, swiglu_limit=1.0)):
        got = torch.ops.moe_fuse.experts(*args, False, epilogue.encode())[0]
        want = reference.experts_forward(*args, **epilogue.kernel_kwargs())
        assert torch.equal(got, want), epilogue
        assert epilogue == Epilogue() or (got - torch.ops.moe_fuse.experts(*args)[0]).abs().max() > 1e-3


def test_weight_layout_strides_are_torchs_rule():
    """ops._layout_strides computes contiguous strides itself for real shapes (torch's helper costs host time in
    every backward): the same strides as torch's rule, size-0 and size-1 dims included; a transposed weight keeps
    its own."""
    import itertools

    from torch._prims_common import make_contiguous_strides_for

    from moe_fuse.ops import _layout_strides

    for shape in itertools.product([0, 1, 3, 8], repeat=3):
        assert _layout_strides(torch.empty(shape)) == tuple(make_contiguous_strides_for(shape)), shape
    stored = torch.empty(4, 6, 10)  # [E, in, out], passed as its transpose
    assert _layout_strides(stored.transpose(1, 2)) == stored.transpose(1, 2).stride()
