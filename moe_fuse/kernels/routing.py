"""Routing metadata on the device: a stable counting sort of the S = T*k routed rows by expert.

Three small launches, no host sync, no atomics (so the permutation is the same
on every run):

1. ``_count_kernel``: each block of ``ROUTE_BLOCK`` rows counts its rows per expert.
2. ``_scan_kernel``: one program per expert turns its column of block counts
   into exclusive prefixes (where the block's rows of that expert start
   inside the expert's segment) and the expert's total.
3. ``_scatter_kernel``: each row's sorted position is
   expert_start[e] + block_prefix[e, block] + (rows of e before it in its block),
   which keeps equal experts in their original order (stable, like
   ``torch.argsort(stable=True)``).

When S fits one block, the scatter kernel counts by itself and the other two
launches are skipped.

Ids >= E are expert-parallel sentinels (experts of another rank, as in
transformers): they count as one extra bucket E, so they land after every real
expert (in row order), are in no GEMM tile, and the combine skips their slots.

The tile schedule of the grouped GEMMs is derived from ``counts`` inside the
GEMM kernels themselves (see grouped_gemm.py), so it can follow each GEMM's own
BLOCK_M.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton.language as tl

from ._jit import cdiv, lazy_jit, next_power_of_2

ROUTE_BLOCK = 128  # rows per counting block; the in-block rank is a ROUTE_BLOCK^2 comparison
SCAN_CHUNK = 1024


class Routing(NamedTuple):
    """Rows grouped by expert. Row r = token * k + slot (the flattened [T, k] index)."""

    order: torch.Tensor  # [S] int32: sorted position -> row, stable within each expert; sentinel rows last
    counts: torch.Tensor  # [E] int32: rows routed to each expert
    offsets: torch.Tensor  # [E + 1] int32: first sorted position of each expert, then the number of routed rows
    pos: torch.Tensor  # [S] int32: row -> sorted position (the inverse of order)
    token: torch.Tensor  # [S] int32: sorted position -> token (order // k), the rows a gather picks
    buf: torch.Tensor  # [buffer_size(S, E)] int32: the one allocation the five above are views of


def buffer_size(S: int, E: int) -> int:
    """int32 elements of ``Routing.buf``: order, pos, token ([S] each), then counts and offsets ([E + 1] each)."""
    return 3 * S + 2 * (E + 1)


def from_buffer(buf: torch.Tensor, S: int, E: int) -> Routing:
    """The Routing whose ``buf`` this is: what a forward keeps so that its backward need not route again."""
    if buf.dtype != torch.int32 or buf.dim() != 1 or buf.numel() != buffer_size(S, E) or not buf.is_contiguous():
        raise ValueError(
            f"saved routing must be a contiguous int32 vector of {buffer_size(S, E)} elements (S={S}, E={E}), "
            f"got {buf.dtype} {tuple(buf.shape)}"
        )
    return _views(buf, S, E)


def _views(buf: torch.Tensor, S: int, E: int) -> Routing:
    # counts keeps E + 1 entries in buf (the kernels count sentinels in bucket E); Routing.counts shows E.
    counts = buf[3 * S : 3 * S + E + 1]
    return Routing(buf[:S], counts[:E], buf[3 * S + E + 1 :], buf[S : 2 * S], buf[2 * S : 3 * S], buf)


@lazy_jit
def _count_kernel(
    ids_ptr,
    block_counts_ptr,  # [E + 1, num_blocks] int32 (bucket E: sentinels)
    S,
    E,
    num_blocks,
    BLOCK: tl.constexpr,
    E_P2: tl.constexpr,  # >= E + 1
):
    pid = tl.program_id(0)
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + rows, mask=rows < S, other=-1).to(tl.int32)
    expert = tl.minimum(expert, E)
    bins = tl.arange(0, E_P2)
    # One-hot compare and sum: [BLOCK, E_P2] is small, and portable to the interpreter.
    hits = (expert[:, None] == bins[None, :]).to(tl.int32)
    counts = tl.sum(hits, axis=0)
    tl.store(block_counts_ptr + bins * num_blocks + pid, counts, mask=bins <= E)


@lazy_jit
def _scan_kernel(
    block_counts_ptr,  # [E + 1, num_blocks] int32, replaced by exclusive prefixes along blocks
    counts_ptr,  # [E + 1] int32
    num_blocks,
    CHUNK: tl.constexpr,
):
    e = tl.program_id(0)
    row = block_counts_ptr + e.to(tl.int64) * num_blocks
    total = tl.zeros((), dtype=tl.int32)
    for start in range(0, num_blocks, CHUNK):
        idx = start + tl.arange(0, CHUNK)
        mask = idx < num_blocks
        c = tl.load(row + idx, mask=mask, other=0)
        tl.store(row + idx, tl.cumsum(c, axis=0) - c + total, mask=mask)
        total += tl.sum(c, axis=0)
    tl.store(counts_ptr + e, total)


@lazy_jit
def _scatter_kernel(
    ids_ptr,
    block_prefix_ptr,  # [E + 1, num_blocks] int32 from _scan_kernel
    counts_ptr,  # [E + 1] int32
    order_ptr,  # [S] int32 out
    offsets_ptr,  # [E + 1] int32 out
    pos_ptr,  # [S] int32 out: the inverse of order
    token_ptr,  # [S] int32 out: order // TOP_K
    S,
    E,
    num_blocks,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    E_P2: tl.constexpr,
    COUNT_HERE: tl.constexpr,  # one block only: count here, skip _count_kernel and _scan_kernel
):
    pid = tl.program_id(0)
    lane = tl.arange(0, BLOCK)
    rows = pid * BLOCK + lane
    valid = rows < S
    expert = tl.minimum(tl.load(ids_ptr + rows, mask=valid, other=-1).to(tl.int32), E)

    bins = tl.arange(0, E_P2)
    if COUNT_HERE:
        counts = tl.sum((expert[:, None] == bins[None, :]).to(tl.int32), axis=0)
        tl.store(counts_ptr + bins, counts, mask=bins <= E)
    else:
        counts = tl.load(counts_ptr + bins, mask=bins <= E, other=0)
    expert_start = tl.cumsum(counts, axis=0) - counts  # [E_P2], exclusive; expert_start[E] = routed rows
    if pid == 0:
        tl.store(offsets_ptr + bins, expert_start, mask=bins <= E)

    # expert_start[expert] per row, without a register gather: sum of counts of smaller experts.
    start_of_row = tl.sum(tl.where(bins[None, :] < expert[:, None], counts[None, :], 0), axis=1)
    # Stable rank inside the block: earlier rows (j < i) with the same expert.
    earlier = (expert[None, :] == expert[:, None]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    position = start_of_row + rank
    if not COUNT_HERE:
        position += tl.load(block_prefix_ptr + expert.to(tl.int64) * num_blocks + pid, mask=valid, other=0)
    tl.store(order_ptr + position, rows, mask=valid)
    tl.store(pos_ptr + rows, position, mask=valid)
    tl.store(token_ptr + position, rows // TOP_K, mask=valid)


def route(ids: torch.Tensor, num_experts: int) -> Routing:
    """Group the rows of ``ids`` [T, k] by expert: ``order`` equals ``reference.expert_order``'s
    over the routed rows; sentinel rows (ids >= E) follow in row order."""
    flat = ids.reshape(-1).contiguous()
    S = flat.numel()
    E = int(num_experts)
    dev = flat.device
    num_blocks = cdiv(S, ROUTE_BLOCK)
    E_P2 = next_power_of_2(E + 1)  # one bucket more, for sentinels
    # One allocation for all five outputs: one allocator call, and one tensor for a forward to keep.
    routing = _views(torch.empty(buffer_size(S, E), dtype=torch.int32, device=dev), S, E)
    order, offsets, pos, token = routing.order, routing.offsets, routing.pos, routing.token
    counts = routing.buf[3 * S : 3 * S + E + 1]  # with the sentinel bucket
    k = ids.shape[-1] if ids.dim() > 1 else 1
    if S == 0:
        routing.buf.zero_()
        return routing
    if num_blocks == 1:
        # Decode-sized batches: one launch instead of three (launches dominate there).
        _scatter_kernel[(1,)](
            flat, counts, counts, order, offsets, pos, token, S, E, 1, TOP_K=k, BLOCK=ROUTE_BLOCK, E_P2=E_P2,
            COUNT_HERE=True,
        )
        return routing
    block_counts = torch.empty(E + 1, num_blocks, dtype=torch.int32, device=dev)
    _count_kernel[(num_blocks,)](flat, block_counts, S, E, num_blocks, BLOCK=ROUTE_BLOCK, E_P2=E_P2)
    chunk = min(SCAN_CHUNK, next_power_of_2(num_blocks))
    _scan_kernel[(E + 1,)](block_counts, counts, num_blocks, CHUNK=chunk)
    _scatter_kernel[(num_blocks,)](
        flat, block_counts, counts, order, offsets, pos, token, S, E, num_blocks, TOP_K=k, BLOCK=ROUTE_BLOCK,
        E_P2=E_P2, COUNT_HERE=False,
    )
    return routing
