"""``torch.ops.moe_fuse.ep_experts``: the chunked expert-parallel experts block as one opaque op for graphs.

    y, *saved = torch.ops.moe_fuse.ep_experts(x, ids, weights, w_gate_up, w_down, group_name, chunks)

y [T, H] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), the experts sharded over the process group
named ``group_name`` (the name functional collectives carry in a graph): this rank holds ``w_gate_up``
[L, 2I, H] and ``w_down`` [L, H, I], experts [rank*L, (rank+1)*L) of E = world*L. It runs what
``overlap.ep_experts_chunked`` runs (one count exchange and host sync, then dispatch / experts / combine
pipelined over ``chunks`` groups of local experts), but as a custom op, so AOTAutograd and Inductor treat
it as one node and never trace the collectives or the host sync inside.

The other outputs are what the backward reads, kept as tensors because that is all an op may return:
y_sorted [T*k, H] (the combined, unweighted expert outputs in chunk-major row order), counts_recv [E] and
the split sizes [2, chunks, world] (on the CPU). All have static shapes. The rows this rank's experts
received are *not* kept: their count is data-dependent, and Dynamo's shape environment refuses
data-dependent output sizes unless ``capture_dynamic_output_shape_ops`` is on. So the backward,
``moe_fuse.ep_experts_backward``, dispatches the token rows again beside the output gradients (chunk by
chunk, overlapped with the experts' backward, which recomputes the gate_up GEMM): one more all-to-all of
[T*k, H] rows than the eager path (``overlap._ChunkedExperts``), which keeps them.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from .. import ops  # noqa: F401  (registers torch.ops.moe_fuse.experts / experts_backward)
from ..kernels.permute import combine_sorted, combine_sorted_backward
from .overlap import (
    chunk_major_order, chunked_backward, chunked_forward, expert_groups, make_plan, no_routing, plan_from,
)
from .permute import inverse_order


def _check(x, ids, weights, w_gate_up, w_down, chunks):
    T, H = x.shape
    L, two_i, h2 = w_gate_up.shape
    if ids.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != T:
        raise ValueError(f"moe_fuse.ep_experts: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be [T={T}, k]")
    if h2 != H or two_i % 2 or tuple(w_down.shape) != (L, H, two_i // 2):
        raise ValueError(
            f"moe_fuse.ep_experts: local weights must be gate_up [L, 2I, H] and down [L, H, I]; got "
            f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)} for hidden size {H}"
        )
    expert_groups(L, chunks)  # ValueError on a bad chunk count


@torch.library.custom_op("moe_fuse::ep_experts", mutates_args=())
def ep_experts(
    x: Tensor, ids: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor, group_name: str, chunks: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check(x, ids, weights, w_gate_up, w_down, chunks)
    group = _resolve_process_group(group_name)
    T, H = x.shape
    k = ids.shape[1]
    L = w_gate_up.shape[0]
    order = chunk_major_order(ids, group.size(), L, chunks)
    x_sorted = x.index_select(0, order // k)  # queued before the host sync in make_plan
    plan = make_plan(ids, group, group.size(), L, chunks)
    y_sorted, _, _ = chunked_forward(x_sorted, w_gate_up, w_down, plan, weights.dtype, save_h=False)
    y = combine_sorted(y_sorted, inverse_order(order, k), weights, x.dtype)
    return y, y_sorted, plan.counts_recv, plan.splits


@ep_experts.register_fake
def _(x, ids, weights, w_gate_up, w_down, group_name, chunks):
    _check(x, ids, weights, w_gate_up, w_down, chunks)
    world = _resolve_process_group(group_name).size()
    T, H = x.shape
    k = ids.shape[1]
    L = w_gate_up.shape[0]
    return (
        x.new_empty((T, H)),
        x.new_empty((T * k, H)),
        ids.new_empty((world * L,), dtype=torch.int64),
        torch.empty((2, chunks, world), dtype=torch.int64, device="cpu"),
    )


@torch.library.custom_op("moe_fuse::ep_experts_backward", mutates_args=())
def ep_experts_backward(
    dy: Tensor, x: Tensor, ids: Tensor, weights: Tensor, y_sorted: Tensor, w_gate_up: Tensor, w_down: Tensor,
    counts_recv: Tensor, splits: Tensor, group_name: str, chunks: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``ep_experts``'s y w.r.t. (x, weights, w_gate_up, w_down)."""
    group = _resolve_process_group(group_name)
    T, H = dy.shape
    k = ids.shape[1]
    L = w_gate_up.shape[0]
    order = chunk_major_order(ids, group.size(), L, chunks)
    plan = plan_from(group, L, chunks, splits, counts_recv)
    # y[t] = sum_j weights[t, j] * y_sorted[pos[t, j]]: d(y_sorted) comes out in expert order, as sent.
    dy_sorted, d_weights = combine_sorted_backward(dy, y_sorted, order, weights, k)
    x_sorted = x.index_select(0, order // k)
    # Recompute gate_up and the routing per chunk.
    nothing_saved = [(w_gate_up.new_empty((0, w_gate_up.shape[1])), no_routing(x))] * len(plan.groups)
    dx_sorted, d_gate_up, d_down = chunked_backward(
        dy_sorted, None, nothing_saved, w_gate_up, w_down, plan, weights.dtype, x_sorted=x_sorted
    )
    dx = combine_sorted(dx_sorted, inverse_order(order, k), None, dx_sorted.dtype)  # sum over each token's slots
    return dx, d_weights.contiguous(), d_gate_up, d_down


@ep_experts_backward.register_fake
def _(dy, x, ids, weights, y_sorted, w_gate_up, w_down, counts_recv, splits, group_name, chunks):
    fmt = torch.contiguous_format
    return tuple(torch.empty_like(t, memory_format=fmt) for t in (x, weights, w_gate_up, w_down))


def _setup_context(ctx, inputs, output):
    x, ids, weights, w_gate_up, w_down, group_name, chunks = inputs
    _y, y_sorted, counts_recv, splits = output
    ctx.save_for_backward(x, ids, weights, y_sorted, w_gate_up, w_down, counts_recv, splits)
    ctx.group_name = group_name
    ctx.chunks = chunks


def _backward(ctx, dy, *_saved_grads):
    # The extra outputs are internal saved values: only y's gradient flows back. Every rank must run this
    # (it holds collectives), as every rank ran the forward.
    x, ids, weights, y_sorted, w_gate_up, w_down, counts_recv, splits = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(x)
    dx, d_weights, d_gate_up, d_down = torch.ops.moe_fuse.ep_experts_backward(
        dy, x, ids, weights, y_sorted, w_gate_up, w_down, counts_recv, splits, ctx.group_name, ctx.chunks
    )
    return dx, None, d_weights, d_gate_up, d_down, None, None


ep_experts.register_autograd(_backward, setup_context=_setup_context)
