"""NaN and inf through the router and experts ops as eager computes them, on the op's three paths: the reference
(CPU), the fused Triton path and the grouped_mm path (their kernels in Triton's interpreter here; tests/gpu/
test_router_gpu.py runs the compiled ones against CUDA eager). Also what the order of tied expert ids changes
downstream (rounding alone), and expert-parallel sentinel slots, which add nothing whatever their weight."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from support.cases import DEVICE  # noqa: E402

from moe_fuse import config, dispatch, kernels  # noqa: E402
import moe_fuse.ops  # noqa: E402,F401  (registers torch.ops.moe_fuse)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning",
                                        "ignore::RuntimeWarning")
T, H, I, E, K = 8, 16, 8, 6, 2  # E not a power of two: the router kernel's block is 8 wide
PATHS = ["reference", "triton", "grouped_mm"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """The ops on one path; the router on its kernel for the two kernel paths."""
    if request.param == "reference" and DEVICE == "cuda":
        pytest.skip("the ops run their kernels on CUDA")
    if request.param != "reference":
        if DEVICE == "cpu":
            monkeypatch.setattr(dispatch, "on_kernels", lambda *a, **k: True)
            monkeypatch.setattr(dispatch, "router_on_kernels", lambda *a: True)
        if request.param == "grouped_mm":
            if DEVICE == "cpu":
                monkeypatch.setattr(dispatch, "grouped_mm_applies", lambda *a: True)
            monkeypatch.setattr(config, "ragged_min_rows", 0)
    with config.patch(grouped_mm=request.param == "grouped_mm"):
        yield request.param


def _weights(seed=0):
    gen = torch.Generator().manual_seed(seed)
    w_router = torch.randn(E, H, generator=gen)
    w_gate_up = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    w_down = torch.randn(E, H, I, generator=gen) / I**0.5
    return w_router, w_gate_up, w_down


def eager_router(logits, k=K):
    """transformers' softmax router: softmax in fp32, torch.topk, renormalised."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    values, ids = torch.topk(probs, k, dim=-1)
    return values / values.sum(dim=-1, keepdim=True), ids


def eager_experts(x, ids, weights, w_gate_up, w_down):
    """transformers' eager experts, one (token, slot) at a time: weight * W_down[e] (silu(gate) * up)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w_gate_up[e] @ x[t]).chunk(2)
            out[t] = out[t] + weights[t, j] * (w_down[e] @ (F.silu(gate) * up))
    return out


def fused(x, w_router, w_gate_up, w_down, k=K):
    logits, weights, ids = torch.ops.moe_fuse.router(x, w_router, k, True, torch.float32)
    return torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down)[0], ids


def _dev(*tensors):
    return [t.to(DEVICE) for t in tensors]


def test_router_nan_rows_give_nan_tokens_as_eager(path):
    """Finite hidden states, a router weight with +inf: tokens with x[:, 0] > 0 get a +inf logit, so an all-NaN
    softmax row and NaN routing weights, and NaN in their whole output as in eager (their ids in [0, E), not the
    kernel block's width, which the experts would skip as a sentinel and leave the token at 0); tokens with
    x[:, 0] < 0 get -inf there (probability 0) and come out as eager's."""
    w_router, w_gate_up, w_down = _weights()
    w_router[1, 0] = float("inf")
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    x[:, 0] = torch.tensor([1.0, -1.0] * (T // 2))
    y, ids = fused(*_dev(x, w_router, w_gate_up, w_down))
    y, ids = y.cpu(), ids.cpu()
    want = eager_experts(x, *reversed(eager_router(F.linear(x, w_router))), w_gate_up, w_down)
    bad = x[:, 0] > 0
    assert bool(((ids >= 0) & (ids < E)).all()), ids
    assert bool(want[bad].isnan().all()) and not want[~bad].isnan().any()
    assert torch.equal(y.isnan(), want.isnan())
    torch.testing.assert_close(y[~bad], want[~bad], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("row", ["nan_entry", "all_nan", "all_neg_inf", "pos_inf"])
def test_logits_rows_through_the_router_kernel_and_experts(row, path):
    """Router logits with a NaN, all NaN, all -inf, a +inf (finite hidden states): the router's softmax-top-k
    (the kernel on the kernel paths) then the experts op: NaN in that token's output as eager, ids in range."""
    w_router, w_gate_up, w_down = _weights(2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen)
    logits = torch.randn(T, E, generator=gen)
    logits[5] = {"nan_entry": logits[5].index_fill(0, torch.tensor([4]), float("nan")),
                 "all_nan": torch.full((E,), float("nan")), "all_neg_inf": torch.full((E,), -float("inf")),
                 "pos_inf": logits[5].index_fill(0, torch.tensor([0]), float("inf"))}[row]
    if path == "reference":
        weights, ids = eager_router(logits)
    else:
        weights, ids = kernels.softmax_topk(logits.to(DEVICE), K, True, torch.float32)
    y = torch.ops.moe_fuse.experts(*_dev(x), ids, weights, *_dev(w_gate_up, w_down))[0].cpu()
    want = eager_experts(x, *reversed(eager_router(logits)), w_gate_up, w_down)
    assert bool(((ids >= 0) & (ids < E)).all()), ids
    assert bool(want[5].isnan().all()) and bool(y[5].isnan().all())
    assert not y[torch.arange(T) != 5].isnan().any()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_nan_hidden_state_forward_and_backward_as_eager(path):
    """A NaN hidden state: NaN in that token's output and its gradient, and in the router weight's gradient, as
    eager autograd gives them; every other token's output and gradient as eager's."""
    w_router, w_gate_up, w_down = _weights(4)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=gen)
    x[2] = float("nan")
    dy = torch.randn(T, H, generator=gen)

    def run(fn, x, w_router):
        x, w_router = x.clone().requires_grad_(), w_router.clone().requires_grad_()
        y = fn(x, w_router)
        dx, dw = torch.autograd.grad(y, (x, w_router), dy.to(y.device))
        return [t.detach().cpu() for t in (y, dx, dw)]

    def eager(x, w_router):
        weights, ids = eager_router(F.linear(x, w_router))
        return eager_experts(x, ids, weights, w_gate_up, w_down)

    got = run(lambda x, w: fused(x, w, *_dev(w_gate_up, w_down))[0], *_dev(x, w_router))
    want = run(eager, x, w_router)
    for name, g, w in zip(("y", "dx", "dw_router"), got, want):
        assert torch.equal(g.isnan(), w.isnan()), name
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True, msg=name)
    assert bool(got[0][2].isnan().all()) and not got[0][torch.arange(T) != 2].isnan().any()
    assert bool(got[1][2].isnan().all()) and not got[1][torch.arange(T) != 2].isnan().any()


def test_tied_ids_in_another_order_move_the_output_by_rounding_alone(path):
    """A zero router weight (transformers' initialisation): every row ties, the router gives ids 0..k-1 with equal
    weights. torch.topk gives them in another order (CUDA's sort: [7, 6, 4, 5, 1, 0, 2, 3] for k = 8, measured on
    an H100); that order permutes equal-weight slots, so the experts' output and every gradient move by the fp32
    rounding of the sum over slots alone. (transformers' load-balancing loss runs its own topk on the logits.)"""
    k, E8 = 8, 10
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(T, H, generator=gen)
    w_gate_up = torch.randn(E8, 2 * I, H, generator=gen) / H**0.5
    w_down = torch.randn(E8, H, I, generator=gen) / I**0.5
    dy = torch.randn(T, H, generator=gen)
    _, weights, ids = torch.ops.moe_fuse.router(*_dev(x, torch.zeros(E8, H)), k, True, torch.float32)
    if path != "reference":  # the kernel's rule; the reference runs torch.topk, whose CPU ties are its own
        assert ids.tolist() == [list(range(k))] * T
    assert bool((weights == weights[:, :1]).all())  # equal weights

    def run(ids, weights):
        leaves = [t.clone().requires_grad_() for t in _dev(x, w_gate_up, w_down)]
        y = torch.ops.moe_fuse.experts(leaves[0], ids, weights, *leaves[1:])[0]
        return [y.detach(), *torch.autograd.grad(y, leaves, dy.to(y.device))]

    cuda_order = torch.tensor([7, 6, 4, 5, 1, 0, 2, 3], device=ids.device)
    for order in (cuda_order, torch.arange(k - 1, -1, -1, device=ids.device)):
        for a, b in zip(run(ids, weights), run(ids[:, order], weights[:, order])):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_sentinel_slots_add_nothing_whatever_their_weight(bad, path):
    """Expert-parallel sentinels (ids >= E) with a NaN or inf routing weight: the output and gradients of the same
    slots with weight 0, what transformers' expert-parallel dispatch passes there (reference.experts_forward)."""
    w_router, w_gate_up, w_down = _weights(7)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:3] for _ in range(T)])
    ids[[1, 4, 6], [0, 2, 1]] = E + 1
    ids[3, :] = E  # a token on other ranks alone: 0
    weights = torch.rand(T, 3, generator=gen)
    sentinel = ids >= E
    dy = torch.randn(T, H, generator=gen)

    def run(weights):
        leaves = [t.clone().requires_grad_() for t in _dev(x, weights, w_gate_up, w_down)]
        y = torch.ops.moe_fuse.experts(leaves[0], ids.to(DEVICE), *leaves[1:])[0]
        return [t.cpu() for t in (y.detach(), *torch.autograd.grad(y, leaves, dy.to(y.device)))]

    got = run(weights.masked_fill(sentinel, bad))
    want = run(weights.masked_fill(sentinel, 0.0))
    assert all(bool(torch.isfinite(g).all()) for g in got)
    assert not got[0][3].any() and not got[2][sentinel].any()  # y of the off-rank token; d_weights at sentinels
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
