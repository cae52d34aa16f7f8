"""Token rows into expert order and back, with backwards that stay in fixed-order kernels.

The expert-parallel paths sort the routed rows (slot = token * k + j) by destination, ship them, and
bring the expert outputs back in the same order. ``order`` [S] is the slot of each sorted position and
``pos`` [T, k] its inverse (the sorted position of each slot). torch's spelling of the two ends --
``x.index_select(0, order // k)`` and ``(y_sorted[pos] * weights[..., None]).sum(1)`` -- backpropagates
through an index_add and fp32 passes over [T, k, H]; here both directions are one pass each
(``moe_fuse.kernels.permute``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from ..kernels.permute import combine_sorted, combine_sorted_backward


def _plain(t: Tensor) -> Tensor:
    # A functional collective's result is a wrapper that waits on first use by a torch op; a Triton
    # launch reads its data pointer directly, so wait here.
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def inverse_order(order: Tensor, top_k: int) -> Tensor:
    """pos [T, k]: the sorted position of each slot (pos[order[p]] = p)."""
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    return pos.view(-1, top_k)


class _ToExpertOrder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, pos: Tensor):
        ctx.save_for_backward(pos)
        ctx.x_dtype = x.dtype
        return x.index_select(0, order // pos.shape[1])

    @staticmethod
    def backward(ctx, d_sorted: Tensor):
        (pos,) = ctx.saved_tensors
        return combine_sorted(_plain(d_sorted), pos, None, ctx.x_dtype), None, None  # dx[t] = sum_j d[pos[t, j]]


class _FromExpertOrder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: Tensor, weights: Tensor, order: Tensor, pos: Tensor, out_dtype: torch.dtype):
        rows = _plain(rows)
        ctx.save_for_backward(rows, weights, order)
        return combine_sorted(rows, pos, weights, out_dtype)

    @staticmethod
    def backward(ctx, dy: Tensor):
        rows, weights, order = ctx.saved_tensors
        d_rows, d_weights = combine_sorted_backward(_plain(dy), rows, order, weights, weights.shape[1])
        return d_rows, d_weights, None, None, None


def to_expert_order(x: Tensor, order: Tensor, pos: Tensor) -> Tensor:
    """x_sorted [S, H] = x[order // k] (differentiable in x)."""
    return _ToExpertOrder.apply(x, order, pos)


def from_expert_order(rows: Tensor, weights: Tensor, order: Tensor, pos: Tensor, out_dtype: torch.dtype) -> Tensor:
    """y [T, H] = sum_j weights[t, j] * rows[pos[t, j]], summed in fp32 in slot order (differentiable in rows
    and weights)."""
    return _FromExpertOrder.apply(rows, weights, order, pos, out_dtype)


__all__ = ["from_expert_order", "inverse_order", "to_expert_order"]
