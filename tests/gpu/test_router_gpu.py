"""The compiled softmax-top-k router kernel against CUDA eager (torch.softmax in fp32, torch.topk, renorm) on NaN,
inf and tied logits, and a NaN router row through the router and experts ops. Small sizes: seconds.

torch.topk promises no order among equal values: on CUDA it picks the same experts as the kernel (the lowest
indices among ties at the k-th value) in its sort's order, the kernel lowest index first (kernels/router.py). So
ids are compared as sets, and exactly on rows without ties."""

import pytest
import torch

from moe_fuse import config, dispatch, reference
from moe_fuse.kernels import softmax_topk, softmax_topk_backward
from support import routing
from support.routing import INF

pytestmark = pytest.mark.gpu


def edge_rows(E, seed=0):
    """[64, E] edge-case logits (support.routing) on the GPU; the rest random, N(0, 9)."""
    return routing.edge_rows(E, torch.Generator().manual_seed(seed), rows=64, scale=3.0).cuda()


def eager(logits, k, renorm, dtype):
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    values, ids = torch.topk(probs, k, dim=-1)
    if renorm:
        values = values / values.sum(dim=-1, keepdim=True)
    return values.to(dtype), ids, probs


def tie_free(probs, k):
    """Rows whose k+1 largest probabilities are distinct numbers (k = E: the k largest)."""
    top = torch.topk(probs, min(k + 1, probs.shape[1]), dim=-1).values
    return (top[:, :-1] > top[:, 1:]).all(-1) & ~probs.isnan().any(-1)


@pytest.mark.parametrize("E", [8, 60, 128])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("renorm, dtype", [(True, torch.float32), (False, torch.bfloat16)])
def test_kernel_against_cuda_topk(E, k, renorm, dtype):
    logits = edge_rows(E).to(dtype)
    weights, ids = softmax_topk(logits, k, renorm, dtype)
    want_w, want_ids, probs = eager(logits, k, renorm, dtype)
    assert bool(((ids >= 0) & (ids < E)).all()), ids[:10]
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)  # the same experts, NaN rows included
    free = tie_free(probs, k)
    assert torch.equal(ids[free], want_ids[free]) and (dtype != torch.float32 or bool(free[10:].all()))
    keys = torch.where(probs.isnan(), INF, probs)  # the kernel's rule: lowest index first among equal values
    assert torch.equal(ids, torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :k])
    assert torch.equal(weights.isnan(), want_w.isnan()) and bool(weights[:5].isnan().all())
    tol = 2e-6 if dtype == torch.float32 else 1e-2  # (equal values: equal weights whatever the slot order)
    torch.testing.assert_close(weights, want_w, rtol=tol, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("renorm", [True, False])
def test_backward_against_cuda_autograd(renorm):
    E, k = 60, 4
    logits = edge_rows(E, seed=1)
    _, ids = softmax_topk(logits, k, renorm, torch.float32)
    gen = torch.Generator(device="cuda").manual_seed(2)
    d_weights, d_direct = torch.randn(64, k, device="cuda", generator=gen), torch.randn(64, E, device="cuda",
                                                                                      generator=gen)
    ref_in = logits.double().requires_grad_()
    values = torch.softmax(ref_in, dim=-1).gather(-1, ids)
    if renorm:
        values = values / values.sum(dim=-1, keepdim=True)
    ((values * d_weights.double()).sum() + (ref_in * d_direct.double()).sum()).backward()
    out = softmax_topk_backward(d_direct, d_weights, logits, ids, renorm)
    assert torch.equal(out.isnan(), ref_in.grad.isnan()) and bool(out[:5].isnan().all())
    torch.testing.assert_close(out.double(), ref_in.grad, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("path", ["grouped_mm", "triton"])
def test_nan_router_rows_through_the_ops(path):
    """Finite hidden states, a router weight with +inf: tokens with x[:, 0] > 0 get a NaN softmax row, NaN
    weights and NaN in their whole output as eager; the others (a -inf logit) eager's output. A zero router
    (every row tied): the output of torch.topk's ids (same experts, its order) up to rounding."""
    if path == "grouped_mm" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the grouped_mm path needs sm90+")
    T, H, I, E, k = 64, 256, 128, 16, 4
    gen = torch.Generator(device="cuda").manual_seed(3)
    rand = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    x = rand(T, H).bfloat16()
    x[:, 0] = torch.tensor([1.0, -1.0], device="cuda").repeat(T // 2).bfloat16()
    w_router = rand(E, H).bfloat16()
    w_router[5, 0] = INF
    w_gate_up, w_down = (rand(E, 2 * I, H) * H**-0.5).bfloat16(), (rand(E, H, I) * I**-0.5).bfloat16()
    with config.patch(grouped_mm=path == "grouped_mm", inference_grouped_mm=path == "grouped_mm"):
        assert dispatch.router_on_kernels(x)
        _, weights, ids = torch.ops.moe_fuse.router(x, w_router, k, True, torch.bfloat16)
        y = torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down)[0]
        assert dispatch.plan(x, ids, weights, w_gate_up, w_down).forward == path
        want_w, want_ids, _ = eager(torch.nn.functional.linear(x, w_router), k, True, torch.bfloat16)
        want = reference.experts_forward(*(t.double() if t.is_floating_point() else t
                                           for t in (x, want_ids, want_w, w_gate_up, w_down)))
        bad = x[:, 0] > 0
        assert bool(((ids >= 0) & (ids < E)).all()) and torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
        assert bool(want[bad].isnan().all()) and bool(y[bad].isnan().all()) and torch.isfinite(y[~bad]).all()
        torch.testing.assert_close(y[~bad].double(), want[~bad], rtol=2e-2, atol=2e-2)

        zero = torch.zeros_like(w_router)
        _, weights, ids = torch.ops.moe_fuse.router(x, zero, k, True, torch.bfloat16)
        want_w, want_ids, _ = eager(torch.nn.functional.linear(x, zero), k, True, torch.bfloat16)
        assert ids.tolist() == [list(range(k))] * T and torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
        y = torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down)[0]
        y_eager_order = torch.ops.moe_fuse.experts(x, want_ids, want_w, w_gate_up, w_down)[0]
        torch.testing.assert_close(y, y_eager_order, rtol=1e-2, atol=1e-2)
