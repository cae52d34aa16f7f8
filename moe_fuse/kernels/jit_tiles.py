"""Which tile a program of the grouped GEMMs computes, as ``jit_helper``s (device functions jitted with their caller:
_jit.py). grouped_gemm.py's docstring describes the grid; its GEMMs and backward.py's share these.

    grouped_tile(pid, num_m_tiles, num_n_tiles, GROUP_M)     program -> (M-tile, N-tile), GROUP_M M-tiles at a time
    expert_tile_counts(counts_ptr, E, BLOCK_M, E_P2)         the experts' rows and M-tiles; their sum bounds the grid
    tile_rows(bins, counts, tiles, pid_m, BLOCK_M)           M-tile -> its expert and rows

A GEMM kernel starts so (a program past the real M-tile count exits before the scan):

    pid_m, pid_n = grouped_tile(tl.program_id(0), num_m_tiles, tl.cdiv(N, BLOCK_N), GROUP_M)
    bins, counts, tiles = expert_tile_counts(counts_ptr, E, BLOCK_M, E_P2)
    if pid_m >= tl.sum(tiles, axis=0):
        return
    expert, tile_in_expert, row_begin, m, row_valid = tile_rows(bins, counts, tiles, pid_m, BLOCK_M)
"""

from __future__ import annotations

import triton.language as tl

from ._jit import jit_helper


@jit_helper
def grouped_tile(pid, num_m_tiles, num_n_tiles, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program pid on a num_m_tiles x num_n_tiles grid: GROUP_M M-tiles walked together over all
    N-tiles (L2 reuse of their A rows and of the weight tiles)."""
    per_group = GROUP_M * num_n_tiles
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@jit_helper
def expert_tile_counts(counts_ptr, E, BLOCK_M: tl.constexpr, E_P2: tl.constexpr):
    """(bins, counts, tiles) [E_P2]: expert indices, rows and M-tiles of BLOCK_M rows per expert (zero past E)."""
    bins = tl.arange(0, E_P2)
    counts = tl.load(counts_ptr + bins, mask=bins < E, other=0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    return bins, counts, tiles


@jit_helper
def tile_rows(bins, counts, tiles, pid_m, BLOCK_M: tl.constexpr):
    """(expert, tile_in_expert, row_begin, m, row_valid) of M-tile pid_m (below the real M-tile count): its expert,
    its index among that expert's tiles, the expert's first sorted row, the tile's rows m [BLOCK_M] counted from
    row_begin, and which of them are the expert's."""
    before = tl.cumsum(tiles, axis=0) <= pid_m  # experts whose tiles all come before pid_m
    expert = tl.sum(before.to(tl.int32), axis=0)
    tile_in_expert = pid_m - tl.sum(tl.where(before, tiles, 0), axis=0)
    row_begin = tl.sum(tl.where(before, counts, 0), axis=0)
    row_count = tl.sum(tl.where(bins == expert, counts, 0), axis=0)
    m = tile_in_expert * BLOCK_M + tl.arange(0, BLOCK_M)
    return expert, tile_in_expert, row_begin, m, m < row_count
