"""Expert parallelism (EP) for transformers' Qwen3-MoE-style experts: the unfused, eager building block.

``shard_experts(model, group)`` keeps, on each rank of ``group``, only that rank's contiguous slice of
E / world experts of every experts module (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], called
as ``experts(hidden_states, top_k_index, top_k_weights)``) and replaces its forward with TorchTitan's
shape of token dispatch:

1. sort the T*k routed rows by global expert id (stable) and count rows per expert;
2. exchange the per-expert counts with ``all_to_all_single`` (each rank learns how many rows it
   receives from every rank for each of its local experts);
3. one ``.tolist()`` turns the counts into the split sizes -- the only host sync, and the thing an
   overlapped version must remove;
4. dispatch: ``all_to_all_single`` (uneven splits, autograd) of the permuted token rows;
5. ``torch.ops.moe_fuse.experts`` on the received rows with local expert ids and k = 1, routing
   weight 1 (received rows arrive grouped by source rank, then by local expert);
6. combine: the reverse ``all_to_all_single`` (autograd);
7. un-permute on the source rank, multiply by the routing weights, sum over the k slots
   (``permute.py``: one fixed-order kernel each way, no index_add in the backward).

Routing weights are applied *after* the combine, on the rank that owns the token (step 7), not before
the return all-to-all: no weights travel, and their gradient is an ordinary local product.

Every step is differentiable (``torch.distributed._functional_collectives.all_to_all_single_autograd``;
its backward is the all-to-all with the splits swapped), so a training step needs nothing else: expert
gradients are complete on their owning rank (they already sum every rank's tokens); non-expert
gradients still need the usual data-parallel all-reduce over the group.

``shard_experts(model, group, chunks=N)`` installs the chunked variant instead (``overlap.py``): the
local experts split into N groups, whose dispatch / combine all-to-alls overlap with the expert
GEMMs of the neighbouring groups, forward and backward; same results, same single host sync.

In compiled graphs, ``moe_fuse/patterns/ep_torchtitan.py`` replaces TorchTitan's dispatch chain (functional
all-to-alls + ``wait_tensor``) by ``torch.ops.moe_fuse.ep_experts`` (``ep_ops.py``) when the backend
gets ``options={"moe_fuse.ep_chunks": N}``.

Not yet covered: transformers' own sentinel-id EP plan in graphs; Triton kernels over
``torch.distributed._symmetric_memory`` with no host sync at all.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._functional_collectives import all_to_all_single_autograd

from .. import ops  # noqa: F401  (registers torch.ops.moe_fuse.*)
from .permute import from_expert_order, inverse_order, to_expert_order
from .overlap import ep_experts_chunked, expert_groups


def _is_experts_module(module: torch.nn.Module) -> bool:
    gu = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (
        isinstance(gu, torch.nn.Parameter)
        and isinstance(down, torch.nn.Parameter)
        and gu.dim() == 3
        and down.dim() == 3
        and gu.shape[0] == down.shape[0]
        and gu.shape[2] == down.shape[1]
        and gu.shape[1] == 2 * down.shape[2]
        and getattr(module, "gate_up_proj_bias", None) is None
        and getattr(module, "down_proj_bias", None) is None
    )


def _is_ungated_experts(module: torch.nn.Module) -> bool:
    """transformers' experts without a gate (``has_gate=False``: an up projection only, Nemotron-H)."""
    return getattr(module, "has_gate", True) is False and isinstance(getattr(module, "up_proj", None), torch.nn.Parameter)


def _not_computed(module: torch.nn.Module) -> str | None:
    """What a transformers experts module computes that the expert-parallel experts (plain SwiGLU over
    [E, 2I, H] and [E, H, I]) would not: a custom or clamped gate, another activation (gelu too), ...; None if
    nothing."""
    if not hasattr(module, "has_gate"):  # not transformers' experts interface: the shape checks are all there is
        return None
    from ..integrations.transformers import experts_epilogue, unsupported_reason
    from ..spec import Epilogue

    reason = unsupported_reason(module)
    if reason is None and experts_epilogue(module) != Epilogue():
        reason = "a clamped gate (swiglu_limit) or a gelu gate, which the expert-parallel path does not take yet"
    return reason


def shard_experts(
    model: torch.nn.Module, group: dist.ProcessGroup | None = None, chunks: int | None = None
) -> torch.nn.Module:
    """Shard every Qwen3-MoE-style experts module of ``model`` over ``group`` (default: the world), in place.

    Rank r keeps experts [r*E/W, (r+1)*E/W) as new parameters and runs the all-to-all forward described
    in the module docstring. ``chunks=N`` pipelines it over N groups of local experts (``overlap.py``);
    None (the default) is the unchunked path. Raises ValueError when E is not a multiple of the group
    size or N is not in [1, E/W], or when an experts module computes something else than SwiGLU experts
    (a custom or clamped gate, another activation, no gate at all). Returns ``model``.
    """
    for module in model.modules():  # before anything else: these would silently stay unsharded
        if _is_ungated_experts(module):
            raise ValueError(f"shard_experts: {type(module).__name__} has no gate (an up projection only), which the "
                             "expert-parallel experts do not compute yet; nothing was sharded")
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    targets = [m for m in model.modules() if _is_experts_module(m) and not hasattr(m, "_moe_fuse_ep")]
    for module in targets:  # validate all before changing any
        reason = _not_computed(module)
        if reason is not None:
            raise ValueError(f"shard_experts: {type(module).__name__} has {reason}, which the expert-parallel "
                             "experts do not compute; nothing was sharded")
        E = module.gate_up_proj.shape[0]
        if E % world:
            raise ValueError(
                f"shard_experts: {type(module).__name__} has E={E} experts, not divisible by the "
                f"expert-parallel world size {world}"
            )
        if chunks is not None:
            expert_groups(E // world, chunks)  # raises ValueError on a bad chunk count
    for module in targets:
        E = module.gate_up_proj.shape[0]
        local = E // world
        lo, hi = rank * local, (rank + 1) * local
        with torch.no_grad():
            gate_up = module.gate_up_proj[lo:hi].clone()
            down = module.down_proj[lo:hi].clone()
        module.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=module.gate_up_proj.requires_grad)
        module.down_proj = torch.nn.Parameter(down, requires_grad=module.down_proj.requires_grad)
        module._moe_fuse_ep = _EPInfo(group=group, world=world, rank=rank, num_experts=E, first_expert=lo, chunks=chunks)
        module.forward = types.MethodType(_ep_experts_forward, module)
    return model


class _EPInfo:
    def __init__(self, group, world, rank, num_experts, first_expert, chunks=None):
        self.group = group
        self.chunks = chunks  # None: unchunked; N: pipelined over N expert groups
        self.world = world
        self.rank = rank
        self.num_experts = num_experts  # global E
        self.local_experts = num_experts // world
        self.first_expert = first_expert

    def __repr__(self):
        return (
            f"EP(rank {self.rank}/{self.world}, experts {self.first_expert}.."
            f"{self.first_expert + self.local_experts - 1} of {self.num_experts}"
            + (f", {self.chunks} chunks)" if self.chunks is not None else ")")
        )


def _ep_experts_forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    return ep_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, self._moe_fuse_ep)


def ep_experts(x: Tensor, ids: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor, ep: _EPInfo) -> Tensor:
    """y [T, H] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) with the experts spread over ``ep.group``.

    With ``ep.chunks`` set, the chunked, overlapped path of ``overlap.py``; otherwise the steps of the
    module docstring. Either way one host sync (the split sizes).
    """
    if ep.chunks is not None:
        return ep_experts_chunked(x, ids, weights, w_gate_up, w_down, ep, ep.chunks)
    T, H = x.shape
    k = ids.shape[1]
    W, L, E = ep.world, ep.local_experts, ep.num_experts

    # 1. Rows (token*k + slot) in global expert order: contiguous per destination rank.
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: CUDA's bincount syncs to size its output.
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))

    # 2. Token-count exchange: counts_recv[r*L + j] = rows rank r sends to my local expert j.
    counts_recv = torch.empty_like(counts)
    dist.all_to_all_single(counts_recv, counts, group=ep.group)

    # 3. The one host sync: split sizes of the two row all-to-alls.
    send_per_rank = counts.view(W, L).sum(1)
    recv_per_rank = counts_recv.view(W, L).sum(1)
    splits = torch.cat([send_per_rank, recv_per_rank]).tolist()
    input_splits, output_splits = splits[:W], splits[W:]
    received = sum(output_splits)

    # 4. Dispatch.
    pos = inverse_order(order, k)
    x_sorted = to_expert_order(x, order, pos)
    x_local = all_to_all_single_autograd(x_sorted, output_splits, input_splits, ep.group)

    # 5. Local experts. Received rows: by source rank, then by local expert id.
    local_ids = torch.repeat_interleave(
        torch.arange(L, device=x.device).repeat(W), counts_recv, output_size=received
    ).unsqueeze(1)
    ones = torch.ones(received, 1, dtype=weights.dtype, device=x.device)
    # Keep h (the gate_up output, which the backward reads instead of recomputing) only when a backward can come.
    save_h = torch.is_grad_enabled() and (x.requires_grad or w_gate_up.requires_grad or w_down.requires_grad)
    y_local = torch.ops.moe_fuse.experts(x_local, local_ids, ones, w_gate_up, w_down, save_h)[0]

    # 6. Combine.
    y_sorted = all_to_all_single_autograd(y_local, input_splits, output_splits, ep.group)

    # 7. Un-permute, routing weights, sum over k (in the slot order, as the one-process op does).
    return from_expert_order(y_sorted, weights, order, pos, x.dtype)
