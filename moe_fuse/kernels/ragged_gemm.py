"""Row-ragged grouped GEMM: out[p] = a[p] @ B[e] for the rows p of expert e, rows sorted by expert.

The same product as ``torch._grouped_mm(a, B, offs=offsets[1:])`` with 128-row steps per expert.
On sm90, torch's CUTLASS kernel computes each expert's rows in multiples of 256 (128-row tiles in
clusters of two): with real routing ~128 rows per expert are computed and dropped, +11-15% on a 30B
gate_up at T=16384 (docs/kernels.md, docs/performance.md, "Rows CUTLASS computes and drops"). Here an expert's
last tile is its only partial one, so ~64 rows per expert are wasted.

Two launches:

- ``tile_map`` lists the M tiles from the routing offsets: int32 [1 + 3 * bound], the tile count,
  then (expert, first row, end row) per tile. Built on the device (no host sync), once in the
  forward and once in the backward, each shared by that pass's GEMMs.
- ``ragged_gemm`` walks (M tile, N tile) pairs on a persistent grid (one program per SM), N tile
  fastest, so an A tile is read from HBM about once while its expert's weight tiles sit in L2.
  A and B come through tensor descriptors (TMA) where shapes allow.

The tile map lives outside the GEMM kernel because a kernel with a reduction or scan in it cannot be
warp-specialized by triton's sm90 pass. (That pass compiles on triton 3.6 but its kernels hung on
the H200, a plain dense GEMM included: docs/kernels.md, docs/performance.md.) fp32 accumulation in K order, one
rounding to ``out``'s dtype: on the H200 the result is bitwise CUTLASS's. Rows past ``offsets[E]``
(expert-parallel sentinels) are in no tile and are left unwritten, as ``torch._grouped_mm`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from ._jit import cdiv, interpreting, lazy_jit, next_power_of_2


@dataclass(frozen=True)
class RaggedConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# 128x256x64, 8 warps, 3 stages: the best of a sweep on an H200 (commit 400b600).
GPU_CONFIG = RaggedConfig(128, 256, 64, 8, 3)
INTERPRETER_CONFIG = RaggedConfig(16, 32, 32, 4, 1)


def block_m() -> int:
    """The M step of this launch setting; a tile map is built for one."""
    return (INTERPRETER_CONFIG if interpreting() else GPU_CONFIG).block_m


@lazy_jit
def _tile_map_kernel(
    offsets_ptr,  # [E + 1] int32
    tiles_ptr,  # [1 + 3 * bound] int32 out
    E,
    bound,
    BLOCK_M: tl.constexpr,
    E_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    bins = tl.arange(0, E_P2)
    lo = tl.load(offsets_ptr + bins, mask=bins < E, other=0)
    hi = tl.load(offsets_ptr + bins + 1, mask=bins < E, other=0)
    per = (hi - lo + BLOCK_M - 1) // BLOCK_M  # M tiles of each expert
    ends = tl.cumsum(per, axis=0)
    first = ends - per
    total = tl.sum(per, axis=0)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # tile t belongs to the number of experts whose tiles all come before it
    e = tl.sum((ends[None, :] <= t[:, None]).to(tl.int32), axis=1)
    sel = bins[None, :] == e[:, None]
    lo_e = tl.sum(tl.where(sel, lo[None, :], 0), axis=1)
    hi_e = tl.sum(tl.where(sel, hi[None, :], 0), axis=1)
    first_e = tl.sum(tl.where(sel, first[None, :], 0), axis=1)
    live = (t < total) & (t < bound)
    tl.store(tiles_ptr + 1 + 3 * t, e, mask=live)
    tl.store(tiles_ptr + 2 + 3 * t, lo_e + (t - first_e) * BLOCK_M, mask=live)
    tl.store(tiles_ptr + 3 + 3 * t, hi_e, mask=live)
    if tl.program_id(0) == 0:
        tl.store(tiles_ptr, total)


def tile_map(offsets: torch.Tensor, rows: int, *, config: RaggedConfig | None = None) -> torch.Tensor:
    """The M tiles of the experts' row ranges ``[offsets[e], offsets[e + 1])``, for ``ragged_gemm``.

    offsets: int32 [E + 1], non-decreasing, offsets[E] <= rows (the operands' row count). config: the
    launch setting of the ``ragged_gemm`` calls it is for (default: this device's).
    """
    if offsets.dim() != 1 or offsets.dtype != torch.int32 or offsets.numel() < 2:
        raise ValueError(f"tile_map: offsets must be int32 [E + 1], got {tuple(offsets.shape)} {offsets.dtype}")
    E = offsets.numel() - 1
    bm = block_m() if config is None else config.block_m
    bound = rows // bm + E  # sum_e ceil(n_e / bm) <= floor(rows / bm) + E
    tiles = torch.empty(1 + 3 * bound, dtype=torch.int32, device=offsets.device)
    e_p2 = next_power_of_2(E)
    block_t = max(16, min(128, 16384 // e_p2))
    _tile_map_kernel[(cdiv(bound, block_t),)](
        offsets, tiles, E, bound, BLOCK_M=bm, E_P2=e_p2, BLOCK_T=block_t, num_warps=4
    )
    return tiles


@lazy_jit
def _ragged_gemm_kernel(
    a_ptr,  # [R, K]
    a_desc,  # a, blocks [BLOCK_M, BLOCK_K] (USE_TMA)
    b_ptr,  # [E, N, K] (B_KMAJOR) or [E, K, N]
    b_desc,  # b viewed 2-D, blocks [BLOCK_N, BLOCK_K] or [BLOCK_K, BLOCK_N] (USE_TMA)
    out_ptr,  # [R, N]
    tiles_ptr,  # tile_map(...)
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_om,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    B_KMAJOR: tl.constexpr,
    USE_TMA: tl.constexpr,
    IEEE: tl.constexpr,
):
    num_n = tl.cdiv(N, BLOCK_N)
    for t in tl.range(tl.program_id(0), tl.load(tiles_ptr) * num_n, num_programs):
        m_tile = t // num_n
        n0 = (t % num_n) * BLOCK_N
        e = tl.load(tiles_ptr + 1 + 3 * m_tile)
        row0 = tl.load(tiles_ptr + 2 + 3 * m_tile)
        row_end = tl.load(tiles_ptr + 3 + 3 * m_tile)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if USE_TMA:
                # Rows past the expert's end read the next expert's rows (or zeros past the tensor),
                # columns past N the next expert's weights: neither is stored. K is a multiple of BLOCK_K.
                a = a_desc.load([row0, k0])
                if B_KMAJOR:
                    b = b_desc.load([e * N + n0, k0]).T
                else:
                    b = b_desc.load([e * K + k0, n0])
            else:
                ks = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(
                    a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :],
                    mask=(rows < row_end)[:, None] & (ks < K)[None, :],
                    other=0.0,
                )
                b = tl.load(
                    b_ptr + e.to(tl.int64) * stride_be + cols[None, :] * stride_bn + ks[:, None] * stride_bk,
                    mask=(cols < N)[None, :] & (ks < K)[:, None],
                    other=0.0,
                )
            if IEEE:  # fp32 operands as fp32 (not tf32); and bf16 tl.dot is wrong in the triton 3.6 interpreter
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < row_end)[:, None] & (cols < N)[None, :])


_SMS: dict = {}


def _sm_count(device: torch.device) -> int:
    # Cached: this launcher runs four times a layer step, and at T=4096 the step is host-bound.
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def _tma_ok(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0


def ragged_gemm(
    a: torch.Tensor, b: torch.Tensor, tiles: torch.Tensor, *, b_kmajor: bool, out: torch.Tensor | None = None,
    config: RaggedConfig | None = None,
) -> torch.Tensor:
    """out [R, N]: out[p] = a[p] @ B[e] for each expert's rows as listed by ``tiles`` (``tile_map``);
    rows in no tile are left unwritten (as they were in ``out``, if given).

    a [R, K]; b [E, N, K] with ``b_kmajor`` (B[e] = b[e]^T: nn.Linear-style weights) else [E, K, N].
    a and b of one floating dtype; out in it. config: another launch setting (benchmarks), with ``tiles``
    built for its block_m.
    """
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"ragged_gemm: a must be 2-D and b 3-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    E = b.shape[0]
    N, K = (b.shape[1], b.shape[2]) if b_kmajor else (b.shape[2], b.shape[1])
    if a.shape[1] != K or a.dtype != b.dtype:
        raise ValueError(
            f"ragged_gemm: a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype} (K={K}): "
            "need a [R, K] of b's dtype"
        )
    R = a.shape[0]
    interpret = interpreting()
    cfg = config or (INTERPRETER_CONFIG if interpret else GPU_CONFIG)
    if tiles.dtype != torch.int32 or tiles.numel() != 1 + 3 * (R // cfg.block_m + E):
        raise ValueError(
            f"ragged_gemm: tiles ({tiles.numel()} {tiles.dtype}) is not tile_map(offsets, rows={R}) of {E} experts"
        )
    if out is None:
        out = torch.empty(R, N, dtype=a.dtype, device=a.device)
    elif tuple(out.shape) != (R, N) or out.dtype != a.dtype or out.stride(1) != 1:
        raise ValueError(f"ragged_gemm: out must be [R={R}, N={N}] {a.dtype} with unit column stride, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if R == 0 or N == 0:
        return out
    a = a if a.stride(1) == 1 else a.contiguous()  # the pointer path assumes unit column stride; b may have any
    # TMA for 2-byte dtypes only: fp32 tiles of this size would not fit three stages in shared memory.
    use_tma = (
        not interpret and a.is_cuda and a.element_size() == 2 and K % cfg.block_k == 0 and _tma_ok(a) and _tma_ok(b)
    )
    a_desc = b_desc = None
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
        if b_kmajor:
            b_desc = TensorDescriptor.from_tensor(b.view(E * N, K), [cfg.block_n, cfg.block_k])
        else:
            b_desc = TensorDescriptor.from_tensor(b.view(E * K, N), [cfg.block_k, cfg.block_n])
    num_tiles = (R // cfg.block_m + E) * cdiv(N, cfg.block_n)  # a bound: the count is on the device
    num_programs = min(num_tiles, _sm_count(a.device) if a.is_cuda else 4)
    # B[e][k, n] = b[e, n, k] (b_kmajor) or b[e, k, n]
    stride_bn, stride_bk = (b.stride(1), b.stride(2)) if b_kmajor else (b.stride(2), b.stride(1))
    _ragged_gemm_kernel[(num_programs,)](
        a, a_desc, b, b_desc, out, tiles,
        N, K, a.stride(0), b.stride(0), stride_bn, stride_bk, out.stride(0), num_programs,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, B_KMAJOR=b_kmajor, USE_TMA=use_tma,
        IEEE=interpret or a.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


__all__ = ["RaggedConfig", "block_m", "ragged_gemm", "tile_map"]
