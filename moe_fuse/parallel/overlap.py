"""Chunked, overlapped expert-parallel experts: dispatch / experts / combine pipelined over N chunks.

The unchunked path (``ep.ep_experts``) runs dispatch all-to-all -> all local experts -> combine
all-to-all back to back, so the network and the GEMMs take turns. Here each rank's local experts are
split into N contiguous groups (chunk c = local experts [ceil(c*L/N), ceil((c+1)*L/N)), the same on
every rank), and the routed rows are sorted chunk-major -- by (chunk, destination rank, local expert)
-- so that every chunk is one contiguous block of rows with its own all-to-all splits. Then

    forward:   issue dispatch(0..N-1)  |  for c: wait dispatch(c); experts(c); issue combine(c)  |  wait all
    backward:  issue the dy all-to-alls(0..N-1)  |  for c: wait; experts_backward(c); issue dx(c)  |  wait all

so the all-to-all of chunk c+1 (and the combine of chunk c-1) run while the experts of chunk c compute,
in the forward and in the backward (``torch.autograd.Function`` below; its backward is
``torch.ops.moe_fuse.experts_backward`` per chunk, saved h included).

``ep_ops.py`` wraps the same two pipelines as custom ops for compiled graphs (there the backward sends
the token rows again instead of keeping the received ones: see its docstring).

Why chunk by expert group rather than by token: each expert's rows stay together in one chunk, so
every expert's weights are read once per pass (as unchunked) and the grouped GEMMs get no extra partial
tiles; and the chunk splits follow from the one per-expert count exchange, with no second exchange.
The cost: chunk sizes follow the routing, so a skewed router gives an uneven pipeline.

Host syncs: one per layer forward -- the copy of the per-chunk split sizes to the host (they come from
the exchanged counts, and the all-to-alls take them as Python ints) -- and none in the backward (the
splits are kept). Every other index tensor is made on the device.

Streams (CUDA): the collectives are issued with ``async_op=True``. The NCCL process group runs them on
its own stream, which waits for the current stream at issue time (so the rows we just gathered are
ready), keeps the buffers alive until ``wait()``, and ``wait()`` makes the current stream wait for the
collective. All buffers are allocated on the current stream and every handle is waited on before
returning, so no tensor is used or freed on one stream while another still touches it; no
``record_stream`` is needed because no tensor of ours crosses to a stream we manage. On gloo (CPU) the
same calls run on gloo's worker threads, overlapping with the compute on the calling thread.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .. import ops  # noqa: F401  (registers torch.ops.moe_fuse.*)
from .permute import from_expert_order, inverse_order, to_expert_order


def expert_groups(local_experts: int, chunks: int) -> list[tuple[int, int]]:
    """The N contiguous groups [lo, hi) of local expert ids, sizes differing by at most one."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    if chunks > local_experts:
        raise ValueError(
            f"chunks={chunks} exceeds the {local_experts} local experts per rank (chunks split the local "
            f"experts into groups; use at most {local_experts})"
        )
    bounds = [-(-c * local_experts // chunks) for c in range(chunks + 1)]  # ceil(c*L/N)
    return list(zip(bounds[:-1], bounds[1:]))


class _Plan:
    """Everything the chunked all-to-alls need, fixed by one forward's routing (host ints + device tensors)."""

    def __init__(self, group, groups, splits, counts_recv, local_ids):
        self.group = group
        self.groups = groups  # [(lo, hi)] local expert ids of each chunk
        self.splits = splits  # int64 [2, chunks, world] on the CPU: rows sent (0) / received (1) per (chunk, rank)
        self.send, self.recv = splits.tolist()  # send[c][r], recv[c][r] (a CPU tensor: no device sync)
        self.counts_recv = counts_recv  # [E]: rows each rank sends to each of my local experts
        self.local_ids = local_ids  # [c] -> [rows, 1] expert id within the chunk's group, of each received row
        self.send_offsets = _offsets([sum(s) for s in self.send])
        self.recv_offsets = _offsets([sum(r) for r in self.recv])


def _offsets(sizes):
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def _chunk_of(num_local: int, chunks: int, device):
    # j is in group c iff c*L <= j*N < (c+1)*L, which is how expert_groups cuts them.
    return torch.arange(num_local, device=device) * chunks // num_local


def chunk_major_order(ids: Tensor, world: int, local_experts: int, chunks: int) -> Tensor:
    """The stable order of the T*k routed rows by (chunk of the local expert, destination rank, local expert)."""
    W, L = world, local_experts
    expert = torch.arange(W * L, device=ids.device)
    key_of_expert = (_chunk_of(L, chunks, ids.device).repeat(W) * W + expert // L) * L + expert % L
    return torch.argsort(key_of_expert[ids.reshape(-1)], stable=True)


def plan_from(group, local_experts: int, chunks: int, splits: Tensor, counts_recv: Tensor) -> _Plan:
    """Rebuild a plan from what a forward kept (the CPU splits and the received counts); no host sync."""
    W, L = splits.shape[2], local_experts
    groups = expert_groups(L, chunks)
    recv_view = counts_recv.view(W, L)
    recv_rows = splits[1].sum(1).tolist()
    local_ids = []
    for c, (lo, hi) in enumerate(groups):
        # Received rows of chunk c: by source rank, then by local expert of the group.
        ids_c = torch.arange(hi - lo, device=counts_recv.device).repeat(W)
        local_ids.append(
            torch.repeat_interleave(ids_c, recv_view[:, lo:hi].reshape(-1), output_size=recv_rows[c]).unsqueeze(1)
        )
    return _Plan(group, groups, splits, counts_recv, local_ids)


def make_plan(ids: Tensor, group, world: int, local_experts: int, chunks: int) -> _Plan:
    """Count rows per expert, exchange the counts (all-to-all), and size every chunk: the one host sync."""
    W, L = world, local_experts
    expert_groups(L, chunks)  # validates chunks
    flat = ids.reshape(-1)
    # scatter_add, not bincount: CUDA's bincount syncs to size its output.
    counts = torch.zeros(W * L, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    # counts_recv[r*L + j] = rows rank r sends to my local expert j.
    counts_recv = torch.empty_like(counts)
    dist.all_to_all_single(counts_recv, counts, group=group)
    chunk_of = _chunk_of(L, chunks, ids.device)
    per_chunk = torch.zeros(2, W, chunks, dtype=torch.int64, device=ids.device)
    per_chunk[0].index_add_(1, chunk_of, counts.view(W, L))
    per_chunk[1].index_add_(1, chunk_of, counts_recv.view(W, L))
    splits = per_chunk.transpose(1, 2).contiguous().to("cpu")  # the host sync: [send/recv, chunk, rank]
    return plan_from(group, L, chunks, splits, counts_recv)


def _a2a(out: Tensor, inp: Tensor, out_splits, in_splits, group):
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)


class _Works:
    """Work handles waited on as one; holds the tensors they read and write until then."""

    def __init__(self, works, tensors=()):
        self.works = works
        self.tensors = tensors  # a temporary (a .contiguous() copy) must outlive its collective

    def wait(self):
        for work in self.works:
            work.wait()


def _dispatch_all(rows_sorted: list[Tensor], plan: _Plan):
    """Issue the dispatch all-to-alls of every chunk, chunk by chunk, of each tensor of ``rows_sorted``.

    Returns (a receive buffer per tensor, one handle per chunk that waits for that chunk of all of them).
    """
    p = plan
    recvs = [rows.new_empty((p.recv_offsets[-1], rows.shape[1])) for rows in rows_sorted]
    works = []
    for c in range(len(p.groups)):
        a, b = p.recv_offsets[c], p.recv_offsets[c + 1]
        lo, hi = p.send_offsets[c], p.send_offsets[c + 1]
        works.append(_Works([_a2a(recv[a:b], rows[lo:hi], p.recv[c], p.send[c], p.group)
                             for rows, recv in zip(rows_sorted, recvs)], tensors=(rows_sorted, recvs)))
    return recvs, works


def chunked_forward(x_sorted: Tensor, w_gate_up: Tensor, w_down: Tensor, plan: _Plan, weights_dtype, save_h: bool):
    """x_sorted [S, H] (chunk-major rows) -> (y_sorted [S, H], x_recv [R, H], [(h, routing) of each chunk]).

    Every row goes through its expert on the rank that owns it and comes back; the all-to-alls of one
    chunk overlap with the experts of another (module docstring). No host sync.
    """
    p = plan
    x_sorted = x_sorted.contiguous()
    y_sorted = torch.empty_like(x_sorted)
    # Issue every dispatch at once: they queue in order on the group's stream (or gloo's threads), and
    # chunk c's experts only wait for dispatch c.
    (x_recv,), sends = _dispatch_all([x_sorted], p)
    saved, outs, combines = [], [], []
    for c, (lo, hi) in enumerate(p.groups):
        sends[c].wait()
        rows = x_recv[p.recv_offsets[c] : p.recv_offsets[c + 1]]
        if rows.shape[0]:
            ones = torch.ones(rows.shape[0], 1, dtype=weights_dtype, device=rows.device)
            # The sorted rows (xs) are not kept: x_recv is, and the backward gathers from it; nor is aw
            # (the dSwiGLU pass writes it again), so a chunk keeps what it kept before aw existed.
            y_c, h_c, _, r_c, _ = torch.ops.moe_fuse.experts(
                rows, p.local_ids[c], ones, w_gate_up[lo:hi], w_down[lo:hi], save_h
            )
        else:  # nothing routed to this group here: skip the kernels, still take part in the all-to-all
            y_c, h_c, r_c = rows, rows.new_empty((0, w_gate_up.shape[1]), dtype=w_gate_up.dtype), no_routing(rows)
        saved.append((h_c, r_c))
        outs.append(y_c)  # kept referenced until its combine is waited on
        combines.append(_a2a(y_sorted[p.send_offsets[c] : p.send_offsets[c + 1]], y_c, p.send[c], p.recv[c], p.group))
    for work in combines:
        work.wait()
    return y_sorted, x_recv, saved


def no_routing(like: Tensor) -> Tensor:
    """The empty routing value of ``moe_fuse.experts``: the backward routes again."""
    return like.new_empty((0,), dtype=torch.int32)


def chunked_backward(dy_sorted: Tensor, x_recv, saved, w_gate_up: Tensor, w_down: Tensor, plan: _Plan, weights_dtype,
                     x_sorted: Tensor | None = None):
    """The reverse of chunked_forward: (dx_sorted [S, H], d_w_gate_up, d_w_down), all-to-alls overlapped likewise.

    ``saved``: each chunk's (h, routing) from ``moe_fuse.experts``, or empty tensors (the experts backward
    then recomputes them).
    ``x_recv`` None: the forward kept no received rows; ``x_sorted`` is dispatched again, chunk by chunk
    beside the gradients (a graph op cannot keep a tensor whose size only the data knows).
    """
    p = plan
    # The reverse of the combine: gradients travel to the experts' ranks like the dispatch did.
    if x_recv is None:
        (dy_recv, x_recv), sends = _dispatch_all([dy_sorted.contiguous(), x_sorted.contiguous()], p)
    else:
        (dy_recv,), sends = _dispatch_all([dy_sorted.contiguous()], p)
    dx_sorted = torch.empty_like(dy_sorted)
    # Every group's slice is written below (zero if it got no rows). Contiguous whatever the weights' strides:
    # the graph op's fake implementation promises so.
    d_gate_up = torch.empty_like(w_gate_up, memory_format=torch.contiguous_format)
    d_down = torch.empty_like(w_down, memory_format=torch.contiguous_format)
    outs, returns = [], []
    for c, (lo, hi) in enumerate(p.groups):
        sends[c].wait()
        a, b = p.recv_offsets[c], p.recv_offsets[c + 1]
        if b > a:
            ones = torch.ones(b - a, 1, dtype=weights_dtype, device=dy_sorted.device)
            dx_c, _, dgu_c, dd_c, _ = torch.ops.moe_fuse.experts_backward(
                dy_recv[a:b], x_recv[a:b], p.local_ids[c], ones, w_gate_up[lo:hi], w_down[lo:hi], saved[c][0],
                x_recv.new_empty((0, x_recv.shape[1])), saved[c][1], w_down.new_empty((0, w_down.shape[2])), "silu",
            )
            d_gate_up[lo:hi] = dgu_c
            d_down[lo:hi] = dd_c
        else:
            dx_c = dy_recv[a:b]
            d_gate_up[lo:hi] = 0
            d_down[lo:hi] = 0
        dx_c = dx_c.contiguous()
        outs.append(dx_c)  # kept referenced until its all-to-all is waited on
        # The reverse of the dispatch: input gradients go back to the rows' ranks.
        returns.append(
            _a2a(dx_sorted[p.send_offsets[c] : p.send_offsets[c + 1]], dx_c, p.send[c], p.recv[c], p.group)
        )
    for work in returns:
        work.wait()
    return dx_sorted, d_gate_up, d_down


class _ChunkedExperts(torch.autograd.Function):
    """x_sorted [S, H] (chunk-major rows) -> y_sorted [S, H]: every row through its expert on its owning rank."""

    @staticmethod
    def forward(ctx, x_sorted: Tensor, w_gate_up: Tensor, w_down: Tensor, plan: _Plan, weights_dtype, save_h: bool):
        y_sorted, x_recv, saved = chunked_forward(x_sorted, w_gate_up, w_down, plan, weights_dtype, save_h)
        ctx.plan = plan
        ctx.weights_dtype = weights_dtype
        ctx.save_for_backward(x_recv, w_gate_up, w_down, *(t for pair in saved for t in pair))
        return y_sorted

    @staticmethod
    def backward(ctx, dy_sorted: Tensor):
        x_recv, w_gate_up, w_down, *flat = ctx.saved_tensors
        saved = list(zip(flat[0::2], flat[1::2]))
        dx_sorted, d_gate_up, d_down = chunked_backward(
            dy_sorted, x_recv, saved, w_gate_up, w_down, ctx.plan, ctx.weights_dtype
        )
        return dx_sorted, d_gate_up, d_down, None, None, None


def ep_experts_chunked(x: Tensor, ids: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor, ep, chunks: int) -> Tensor:
    """Same result as ``ep.ep_experts`` with dispatch and combine pipelined over ``chunks`` expert groups.

    One host sync per call (in ``make_plan``: the split sizes); see the module docstring.
    """
    T, H = x.shape
    k = ids.shape[1]
    order = chunk_major_order(ids, ep.world, ep.local_experts, chunks)
    pos = inverse_order(order, k)
    x_sorted = to_expert_order(x, order, pos)  # queued before the host sync in make_plan: the device works meanwhile
    plan = make_plan(ids, ep.group, ep.world, ep.local_experts, chunks)
    # Keep h (the gate_up output, which the backward reads instead of recomputing) only when a backward can come.
    save_h = torch.is_grad_enabled() and (x.requires_grad or w_gate_up.requires_grad or w_down.requires_grad)
    y_sorted = _ChunkedExperts.apply(x_sorted, w_gate_up, w_down, plan, weights.dtype, save_h)

    # Un-permute, routing weights, sum over k (in the slot order, as the one-process op does).
    return from_expert_order(y_sorted, weights, order, pos, x.dtype)
