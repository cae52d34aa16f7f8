"""The row-ragged grouped GEMM: out[p] = a[p] @ B[e] for the rows p of expert e, rows sorted by expert.

Same result as ``torch._grouped_mm(a, B_as_[E, K, N], offs=offsets[1:])``, with a different tile
schedule. On sm90, torch's CUTLASS kernel computes each expert's rows in whole multiples of 256
(128-row tiles in clusters of two). With real routing about 128 rows per expert are computed and
dropped: +11-15% on a 30B gate_up at T=16384, +36-45% at T=4096 (bench/KERNELS_NOTES.md, "Rows
CUTLASS computes and drops"). Here each expert is cut into BLOCK_M-row tiles, so at most
BLOCK_M - 1 rows per expert are computed for nothing.

``b`` is [E, N, K] (``b_kmajor``: each expert's matrix stored as out-features x in-features, like
nn.Linear weights) or [E, K, N]. Programs are persistent: ``num_programs`` of them walk the
(M-tile, N-tile) pairs, N-tile fastest, so an A tile is read from HBM about once while its
expert's weight tiles stay in L2. The tile -> expert map is a prefix sum over ``counts``
inside the kernel: no host sync. Rows past ``offsets[E]`` (expert-parallel sentinels) are in no
tile and are not written. fp32 accumulation, one rounding to ``out``'s dtype; deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from ._jit import cdiv, interpreting, lazy_jit, next_power_of_2


@dataclass(frozen=True)
class RaggedConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 8
    num_stages: int = 3
    use_tma: bool = True  # A and B through tensor descriptors (sm90+, 16-byte aligned rows)
    programs_per_sm: int = 1  # 0: one program per tile (no persistence)
    flatten: bool = False  # let the compiler pipeline across tiles (tl.range flatten); not with split_tail
    split_tail: bool = True  # an expert's last <= block_m / 2 rows in a tile of block_m / 2 rows
    num_ctas: int = 1  # CTAs per program (a cluster, sm90+)


INTERPRETER_CONFIG = RaggedConfig(16, 32, 32, 4, 1, use_tma=False)
DEFAULT_CONFIG = RaggedConfig(128, 256, 64, 8, 3)


@lazy_jit
def _ragged_gemm_kernel(
    a_ptr,  # [R, K], rows sorted by expert
    a_desc,  # descriptor of a, blocks [BLOCK_M, BLOCK_K] (USE_TMA only)
    a_half_desc,  # descriptor of a, blocks [BLOCK_M // 2, BLOCK_K] (USE_TMA and SPLIT_TAIL only)
    b_ptr,  # [E, N, K] (B_KMAJOR) or [E, K, N]
    b_desc,  # descriptor of b viewed 2-D, blocks [BLOCK_N, BLOCK_K] or [BLOCK_K, BLOCK_N] (USE_TMA only)
    out_ptr,  # [R, N]
    counts_ptr,  # [E] int32 rows per expert
    N,
    K,
    E,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_om,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_P2: tl.constexpr,
    B_KMAJOR: tl.constexpr,
    USE_TMA: tl.constexpr,
    SPLIT_TAIL: tl.constexpr,
    FLATTEN: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # ---- the tile list, from the counts: first every expert's BLOCK_M-row tiles (its last one
    # partial), then, with SPLIT_TAIL, one half-height tile per expert whose last rows fit in one.
    bins = tl.arange(0, E_P2)
    counts = tl.load(counts_ptr + bins, mask=bins < E, other=0)
    starts = tl.cumsum(counts, axis=0) - counts  # first row of each expert
    tail = counts % BLOCK_M
    if SPLIT_TAIL:
        short_tail = (tail > 0) & (tail <= BLOCK_M // 2)
        full = counts // BLOCK_M + (tail > BLOCK_M // 2).to(tl.int32)
    else:
        short_tail = tail < 0  # none
        full = (counts + BLOCK_M - 1) // BLOCK_M
    full_ends = tl.cumsum(full, axis=0)
    half_ends = tl.cumsum(short_tail.to(tl.int32), axis=0)
    num_n = tl.cdiv(N, BLOCK_N)
    total_full = tl.sum(full, axis=0) * num_n
    total = total_full + tl.sum(short_tail.to(tl.int32), axis=0) * num_n
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    for t in tl.range(tl.program_id(0), total, num_programs, flatten=FLATTEN):
        is_half = t >= total_full
        u = tl.where(is_half, t - total_full, t)
        m_tile = u // num_n
        n0 = (u % num_n) * BLOCK_N
        ends = tl.where(is_half, half_ends, full_ends)
        before = ends <= m_tile  # experts whose tiles (of this kind) all come before this one
        e = tl.sum(before.to(tl.int32), axis=0)
        start = tl.sum(tl.where(bins == e, starts, 0), axis=0)
        row_end = start + tl.sum(tl.where(bins == e, counts, 0), axis=0)
        full_before = tl.sum(tl.where(before, full, 0), axis=0)
        row0 = start + tl.where(is_half, tl.sum(tl.where(bins == e, full, 0), axis=0), m_tile - full_before) * BLOCK_M
        cols = n0 + rn
        # The same code for both tile heights, unrolled at compile time (lazy_jit kernels cannot call
        # jitted helpers); HALF = 1 only with SPLIT_TAIL.
        for HALF in tl.static_range(1 + SPLIT_TAIL):
            if is_half == (HALF == 1):
                BM: tl.constexpr = BLOCK_M // (1 + HALF)
                rows = row0 + tl.arange(0, BM)
                acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    # Rows past the expert's end read the next expert's rows (or TMA's zeros past the
                    # tensor) and are never stored. On the TMA path K is a multiple of BLOCK_K.
                    if USE_TMA:
                        if HALF == 1:
                            a = a_half_desc.load([row0, k0])
                        else:
                            a = a_desc.load([row0, k0])
                        if B_KMAJOR:
                            b = b_desc.load([e * N + n0, k0]).T
                        else:
                            b = b_desc.load([e * K + k0, n0])
                    else:
                        ks = k0 + rk
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
                    if INTERPRET:  # bf16 tl.dot is wrong in the triton 3.6 interpreter, and its tf32 rounds
                        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
                    else:
                        acc = tl.dot(a, b, acc)
                mask = (rows < row_end)[:, None] & (cols < N)[None, :]
                out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
                tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _tma_ok(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0


def ragged_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    counts: torch.Tensor,
    *,
    b_kmajor: bool,
    config: RaggedConfig | None = None,
) -> torch.Tensor:
    """out [R, N] with out[p] = a[p] @ B[e] for the rows of each expert (``counts[e]`` rows, in order
    from row 0); rows past sum(counts) are left unwritten.

    a [R, K]; b [E, N, K] if ``b_kmajor`` (B[e] = b[e]^T) else [E, K, N]; counts [E] int32 on a's
    device. Same dtype for a and b; out in that dtype.
    """
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"ragged_gemm: a must be 2-D and b 3-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    E = b.shape[0]
    N, K = (b.shape[1], b.shape[2]) if b_kmajor else (b.shape[2], b.shape[1])
    if a.shape[1] != K or a.dtype != b.dtype or counts.shape != (E,) or counts.dtype != torch.int32:
        raise ValueError(
            f"ragged_gemm: a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype} (K={K}), "
            f"counts {tuple(counts.shape)} {counts.dtype}: need a [R, K], the same dtype, counts [E] int32"
        )
    R = a.shape[0]
    out = torch.empty(R, N, dtype=a.dtype, device=a.device)
    if R == 0 or N == 0:
        return out
    cfg = INTERPRETER_CONFIG if interpreting() else (config or DEFAULT_CONFIG)
    a = a if a.stride(1) == 1 else a.contiguous()
    use_tma = cfg.use_tma and K % cfg.block_k == 0 and _tma_ok(a) and _tma_ok(b)
    split_tail = cfg.split_tail and cfg.block_m % 2 == 0
    a_desc = a_half_desc = b_desc = None
    if use_tma:
        a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
        if split_tail:
            a_half_desc = TensorDescriptor.from_tensor(a, [cfg.block_m // 2, cfg.block_k])
        if b_kmajor:
            b_desc = TensorDescriptor.from_tensor(b.view(E * N, K), [cfg.block_n, cfg.block_k])
        else:
            b_desc = TensorDescriptor.from_tensor(b.view(E * K, N), [cfg.block_k, cfg.block_n])
    # The tile count is on the device; its bound sum_e ceil(c_e / BM) <= ceil(R / BM) + E sizes the grid.
    tiles_bound = (cdiv(R, cfg.block_m) + E) * cdiv(N, cfg.block_n)
    if cfg.programs_per_sm and a.is_cuda:
        sms = torch.cuda.get_device_properties(a.device).multi_processor_count
        num_programs = min(tiles_bound, sms * cfg.programs_per_sm // cfg.num_ctas)
    else:
        num_programs = tiles_bound
    # [E, N, K]: B[e][k, n] = b[e, n, k]; [E, K, N]: B[e][k, n] = b[e, k, n]
    stride_bn, stride_bk = (b.stride(1), b.stride(2)) if b_kmajor else (b.stride(2), b.stride(1))
    _ragged_gemm_kernel[(num_programs,)](
        a, a_desc, a_half_desc, b, b_desc, out, counts,
        N, K, E, a.stride(0), b.stride(0), stride_bn, stride_bk, out.stride(0), num_programs,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, E_P2=next_power_of_2(E),
        B_KMAJOR=b_kmajor, USE_TMA=use_tma, SPLIT_TAIL=split_tail, FLATTEN=cfg.flatten and not split_tail,
        INTERPRET=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"num_ctas": cfg.num_ctas} if cfg.num_ctas > 1 else {}),
    )
    return out


__all__ = ["DEFAULT_CONFIG", "RaggedConfig", "ragged_gemm"]
