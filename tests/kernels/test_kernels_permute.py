"""The expert-order permute kernels (combines, row expansion) against torch (interpreter on CPU)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moe_fuse.kernels.permute import combine_sorted, combine_sorted_backward, expand_rows  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(T, k, H, dtype, w_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    S = T * k
    order = torch.randperm(S, generator=gen)  # slot of each sorted position
    pos = torch.empty_like(order)
    pos[order] = torch.arange(S)
    rows = torch.randn(S, H, generator=gen).to(dtype)
    weights = None if w_dtype is None else torch.rand(T, k, generator=gen).to(w_dtype)
    dy = torch.randn(T, H, generator=gen).to(dtype)
    return order, pos.view(T, k), rows, weights, dy


@pytest.mark.parametrize(
    "T, k, H, dtype, w_dtype",
    [
        (37, 2, 48, torch.float32, torch.float32),
        (20, 8, 300, torch.bfloat16, torch.float32),  # H past one block, bf16 rows, fp32 weights
        (9, 3, 16, torch.bfloat16, torch.bfloat16),
        (13, 4, 64, torch.float32, None),  # unweighted: the backward of the dispatch gather
    ],
)
def test_combine_sorted_and_backward_match_float64(T, k, H, dtype, w_dtype):
    order, pos, rows, weights, dy = case(T, k, H, dtype, w_dtype, seed=T * k + H)
    rows_ref = rows.double().requires_grad_()
    w_ref = weights.double().requires_grad_() if weights is not None else None
    picked = rows_ref[pos.reshape(-1)].view(T, k, H)
    y_ref = (picked * w_ref.unsqueeze(-1)).sum(1) if w_ref is not None else picked.sum(1)
    (y_ref * dy.double()).sum().backward()

    to = lambda t: t.to(DEVICE) if t is not None else None  # noqa: E731
    y = combine_sorted(to(rows), to(pos), to(weights), dtype)
    tol = 1e-5 if dtype == torch.float32 and w_dtype in (None, torch.float32) else 2e-2
    assert y.dtype == dtype and y.shape == (T, H)
    torch.testing.assert_close(y.cpu().double(), y_ref.detach(), rtol=tol, atol=tol)

    d_rows, d_w = combine_sorted_backward(to(dy), to(rows), to(order), to(weights), k)
    assert d_rows.dtype == rows.dtype and d_rows.shape == rows.shape
    torch.testing.assert_close(d_rows.cpu().double(), rows_ref.grad, rtol=tol, atol=tol)
    if weights is None:
        assert d_w is None
    else:
        assert d_w.dtype == weights.dtype and d_w.shape == weights.shape
        torch.testing.assert_close(d_w.cpu().double(), w_ref.grad, rtol=tol, atol=tol * H ** 0.5)


def test_torch_fallback_matches_kernels():
    """Off the kernels' devices (CPU without the interpreter) the same functions run torch ops: same answer."""
    order, pos, rows, weights, dy = case(11, 3, 40, torch.float32, torch.float32, seed=5)
    import moe_fuse.kernels.permute as permute

    got = combine_sorted(rows.to(DEVICE), pos.to(DEVICE), weights.to(DEVICE), torch.float32).cpu()
    x = torch.randn(11, 40)
    expanded = expand_rows(x.to(DEVICE), pos.to(DEVICE)).cpu()
    grads = [g.cpu() for g in combine_sorted_backward(dy.to(DEVICE), rows.to(DEVICE), order.to(DEVICE),
                                                      weights.to(DEVICE), 3)]
    use = permute._use_kernels
    permute._use_kernels = lambda t: False
    try:
        want = combine_sorted(rows, pos, weights, torch.float32)
        want_grads = combine_sorted_backward(dy, rows, order, weights, 3)
        want_expanded = expand_rows(x, pos)
    finally:
        permute._use_kernels = use
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(expanded, want_expanded)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T, k, H, dtype", [(37, 2, 48, torch.float32), (20, 8, 300, torch.bfloat16), (5, 1, 16, torch.float32)])
def test_expand_rows_is_the_gather_of_token_rows(T, k, H, dtype):
    """out[p] = x[order[p] // k]: every sorted position (a permutation of the slots) gets its token's row, exactly."""
    order, pos, _, _, _ = case(T, k, H, dtype, None, seed=T + k)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = expand_rows(x.to(DEVICE), pos.to(torch.int32).to(DEVICE))
    assert out.shape == (T * k, H) and out.dtype == dtype
    assert torch.equal(out.cpu(), x[order // k])
    # A column view (non-contiguous x) and int64 positions give the same rows.
    wide = torch.cat([x, x], dim=1)[:, :H]
    assert torch.equal(expand_rows(wide.to(DEVICE), pos.to(DEVICE)).cpu(), x[order // k])
