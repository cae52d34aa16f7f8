"""The Triton softmax top-k router kernel against torch (Triton interpreter on CPU)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moe_fuse import reference  # noqa: E402
from moe_fuse.kernels import softmax_topk, softmax_topk_backward  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def torch_router(logits, k, renorm, weights_dtype):
    """torch's softmax top-k, with ties resolved like CUDA's torch.topk: lowest index first.

    (A stable sort makes the tie order explicit; CPU torch.topk leaves it unspecified.)"""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
    ids = order[:, :k]
    values = probs.gather(-1, ids)
    torch.testing.assert_close(values, torch.topk(probs, k, dim=-1).values, rtol=0, atol=0)
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
