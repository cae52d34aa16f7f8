"""The Triton softmax top-k router kernel against torch (Triton interpreter on CPU)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moe_fuse import reference  # noqa: E402
from moe_fuse.kernels import softmax_topk, softmax_topk_backward  # noqa: E402
from support.routing import INF, edge_rows  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
    # the interpreter's numpy on NaN and inf rows
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def torch_router(logits, k, renorm, weights_dtype):
    """torch's softmax top-k with the kernel's tie rule: NaN above every number (as torch.topk ranks it), equal
    values lowest index first, for the experts picked and their order.

    (A stable sort makes the rule explicit. torch.topk promises no tie order: CPU picks other experts among ties,
    CUDA the same experts in its bitonic sort's order; kernels/router.py. Its values are these.)"""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    keys = torch.where(probs.isnan(), float("inf"), probs)
    ids = torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :k]
    values = probs.gather(-1, ids)
    torch.testing.assert_close(values, torch.topk(probs, k, dim=-1).values, rtol=0, atol=0, equal_nan=True)
    if renorm:
        values = values / values.sum(dim=-1, keepdim=True)
    return values.to(weights_dtype), ids


@pytest.mark.parametrize(
    "T, E, k, renorm, dtype",
    [
        (37, 8, 2, True, torch.float32),
        (64, 128, 8, True, torch.bfloat16),
        (5, 6, 6, False, torch.float16),  # k = E
        (1, 7, 1, True, torch.float32),  # T = 1, k = 1, E not a power of two
        (33, 60, 4, False, torch.bfloat16),
    ],
)
def test_matches_torch(T, E, k, renorm, dtype):
    gen = torch.Generator().manual_seed(T * E + k)
    logits = (torch.randn(T, E, generator=gen) * 2).to(dtype).to(DEVICE)
    weights, ids = softmax_topk(logits, k, renorm, dtype)
    want_w, want_ids = torch_router(logits, k, renorm, dtype)
    assert ids.dtype == torch.int64 and weights.dtype == dtype
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=2e-6 if dtype == torch.float32 else 1e-2, atol=1e-7)


def test_strided_logits_and_fp32_weights_from_bf16_logits():
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(16, 24, generator=gen).to(torch.bfloat16).to(DEVICE)
    logits = wide[:, :12]  # row stride 24
    weights, ids = softmax_topk(logits, 3, True, torch.float32)
    want_w, want_ids = torch_router(logits, 3, True, torch.float32)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=2e-6, atol=1e-7)


def test_ties_pick_equal_values_lowest_index_first():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]], device=DEVICE)
    weights, ids = softmax_topk(logits, 2, False, torch.float32)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, torch_router(logits, 2, False, torch.float32)[0])


@pytest.mark.parametrize("E", [8, 6, 60, 128])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("renorm, dtype", [(True, torch.float32), (False, torch.float32), (True, torch.bfloat16)])
def test_non_finite_and_tied_rows(E, k, renorm, dtype):
    """NaN, +inf and all--inf rows: ids in [0, E), their first k experts (torch.topk's values: NaN, ranked first),
    NaN weights where torch gives NaN; ties lowest index first; the other rows as torch computes them."""
    logits = edge_rows(E, torch.Generator().manual_seed(E + k)).to(dtype)
    weights, ids = softmax_topk(logits.to(DEVICE), k, renorm, dtype)
    want_w, want_ids = torch_router(logits, k, renorm, dtype)
    ids, weights = ids.cpu(), weights.cpu()
    assert bool(((ids >= 0) & (ids < E)).all()), ids
    assert torch.equal(ids, want_ids), (ids, want_ids)
    assert torch.equal(weights.isnan(), want_w.isnan())
    assert bool(weights[:5].isnan().all()) and torch.equal(ids[:5], torch.arange(k).expand(5, k))
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(weights, want_w, rtol=tol, atol=1e-7, equal_nan=True)
    assert torch.equal(ids[7], torch.arange(k)) and bool((weights[7] == (1 / k if renorm else 1 / E)).all())
    assert ids[8, :2].tolist() == [0, E - 2][:k]


@pytest.mark.parametrize("E, k", [(8, 8), (60, 8), (6, 6)])
def test_all_equal_rows_pick_lowest_ids_first(E, k):
    """A zero router weight (transformers' initialisation) gives equal logits on every row: ids 0..k-1 in order,
    weights 1/E (1/k renormalised); also with equal -inf logits but one (zeros tie behind it)."""
    logits = torch.zeros(5, E)
    logits[3:] = -INF
    logits[3:, E - 1] = 0.0
    for renorm in (False, True):
        weights, ids = softmax_topk(logits.to(DEVICE), k, renorm, torch.float32)
        want_w, want_ids = torch_router(logits, k, renorm, torch.float32)
        assert torch.equal(ids.cpu(), want_ids)
        assert ids[:3].tolist() == [list(range(k))] * 3 and ids[3].tolist() == [E - 1, *range(k - 1)]
        torch.testing.assert_close(weights.cpu(), want_w, rtol=0, atol=0)


@pytest.mark.parametrize("renorm", [True, False])
def test_backward_of_non_finite_rows_is_nan_as_autograd(renorm):
    """The kernel's forward then its backward on NaN, +inf and all--inf rows: NaN where float64 autograd of
    softmax -> pick -> [renorm] gives NaN (the whole row), its values elsewhere."""
    E, k = 60, 4
    gen = torch.Generator().manual_seed(3)
    logits = edge_rows(E, gen)
    _, ids = softmax_topk(logits.to(DEVICE), k, renorm, torch.float32)
    d_weights = torch.randn(11, k, generator=gen)
    d_direct = torch.randn(11, E, generator=gen)
    ref_in = logits.double().requires_grad_()
    values = torch.softmax(ref_in, dim=-1).gather(-1, ids.cpu())
    if renorm:
        values = values / values.sum(dim=-1, keepdim=True)
    ((values * d_weights.double()).sum() + (ref_in * d_direct.double()).sum()).backward()
    assert bool(ref_in.grad[:5].isnan().all()) and not ref_in.grad[6:].isnan().any()
    out = softmax_topk_backward(d_direct.to(DEVICE), d_weights.to(DEVICE), logits.to(DEVICE), ids, renorm)
    torch.testing.assert_close(out.cpu().double(), ref_in.grad, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_bad_k():
    with pytest.raises(ValueError, match="top-k 5 with 4 experts"):
        softmax_topk(torch.randn(3, 4, device=DEVICE), 5, True, torch.float32)


@pytest.mark.parametrize(
    "T, E, k, renorm, dtype, direct",
    [
        (37, 8, 2, True, torch.float32, True),
        (64, 128, 8, True, torch.bfloat16, False),
        (5, 6, 6, False, torch.float32, True),  # k = E
        (33, 60, 4, False, torch.bfloat16, True),
    ],
)
def test_backward_matches_float64_autograd(T, E, k, renorm, dtype, direct):
    """d(logits) of softmax(fp32) -> pick ids -> [renorm], plus the gradient that reached the logits
    directly (``direct``) or none (None), against float64 autograd on fresh random inputs."""
    gen = torch.Generator().manual_seed(7 * T + E)
    logits = (torch.randn(T, E, generator=gen) * 2).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    d_weights = torch.randn(T, k, generator=gen)
    d_direct = torch.randn(T, E, generator=gen).to(dtype) if direct else None

    ref_in = logits.double().requires_grad_()
    values = torch.softmax(ref_in, dim=-1).gather(-1, ids)
    if renorm:
        values = values / values.sum(dim=-1, keepdim=True)
    loss = (values * d_weights.double()).sum()
    if direct:
        loss = loss + (ref_in * d_direct.double()).sum()
    loss.backward()

    out = softmax_topk_backward(
        d_direct.to(DEVICE) if direct else None, d_weights.to(DEVICE), logits.to(DEVICE), ids.to(DEVICE), renorm
    )
    assert out.dtype == dtype and out.shape == (T, E)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().double(), ref_in.grad, rtol=tol, atol=tol)
    # The op's torch path (reference.router_backward) agrees through its two matmuls.
    x = torch.randn(T, 16, generator=gen).to(dtype)
    w = torch.randn(E, 16, generator=gen).to(dtype)
    dx, dw = reference.router_backward(
        d_direct if direct else torch.zeros_like(logits), d_weights, x, w, logits, ids, renorm
    )
    # (bf16 products of operands a rounding apart: compare as a relative norm.)
    for got, want in ((out.cpu() @ w, dx), (out.cpu().t() @ x, dw)):
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < (1e-6 if dtype == torch.float32 else 1e-2), err
