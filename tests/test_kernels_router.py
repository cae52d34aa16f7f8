"""The Triton softmax top-k router kernel against torch (Triton interpreter on CPU)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moe_fuse.kernels import softmax_topk  # noqa: E402

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
