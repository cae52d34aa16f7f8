"""Two GEMMs of the grouped_mm path over expert-sorted rows, each with its elementwise pass fused in.

    gate_up_swiglu:  h = xs @ W_gate_up[e]^T  [S, 2I];  aw = w * silu(gate) * up  [S, I]
    dgrad_dswiglu:   g = dys @ W_down[e]      [S, I];  d_h = dSwiGLU(w * g), sum_i g * a per tile

They replace ``torch._grouped_mm`` followed by the SwiGLU pass (forward), and ``torch._grouped_mm``
followed by the dSwiGLU pass (backward). The fused epilogue reads and writes what the pass did, minus
one round trip of the GEMM output: h is not read back in the forward, and g is never stored.

Why not CUTLASS for these two: torch's grouped GEMM on sm90 computes each expert's rows in whole
multiples of 256 (128-row tiles in clusters of two). Here each expert is cut into BLOCK_M-row tiles,
and persistent programs walk the (M-tile, N-tile) pairs with the N-tile fastest, which reuses the A
tile from L2. The tile -> expert map is a prefix sum over ``counts`` in the kernel, so there is no
host sync. Rows outside every expert (expert-parallel sentinels, past ``offsets[E]``) are in no
tile and are not written. Measured in bench/KERNELS_NOTES.md ("Rows CUTLASS computes and drops").

A and B come through tensor descriptors (TMA) on sm90+, and through masked pointer loads in the
interpreter. fp32 accumulation. The rounding points are the unfused path's, so the results are
the same bits:
- the forward rounds h to bf16, then computes aw from the rounded gate and up;
- the backward rounds g before the dSwiGLU math.
The one exception: the backward's d_weights is a sum of per-tile partials in tile order, not one
row sum. It is deterministic either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from ._jit import cdiv, interpreting, lazy_jit, next_power_of_2
from .routing import Routing


@dataclass(frozen=True)
class SortedGemmConfig:
    block_m: int
    block_n: int  # gate_up_swiglu: the width of each of the gate and up halves
    block_k: int
    num_warps: int = 8
    num_stages: int = 3
    tma_epilogue: bool = True  # dgrad_dswiglu: h and d_h through descriptors


# H200, 30B layer, T=16384 (bench/probe_tile_waste_gpu.py --fused).
GATE_UP_CONFIG = SortedGemmConfig(128, 128, 64, 8, 3)
DGRAD_CONFIG = SortedGemmConfig(128, 256, 64, 8, 3)
INTERPRETER_CONFIG = SortedGemmConfig(16, 32, 32, 4, 1)


@lazy_jit
def _gate_up_swiglu_kernel(
    x_ptr,  # [R, H] rows sorted by expert
    x_desc,  # blocks [BLOCK_M, BLOCK_K] (USE_TMA only)
    w_ptr,  # [E, 2I, H]
    w_desc,  # [E * 2I, H] view, blocks [BLOCK_N, BLOCK_K] (USE_TMA only)
    h_ptr,  # [R, 2I] out: gate | up
    aw_ptr,  # [R, I] out: w * silu(gate) * up
    rw_ptr,  # [T * k] routing weights, by row
    order_ptr,  # [R] int32: sorted position -> row
    counts_ptr,  # [E] int32
    I,
    H,
    E,
    stride_we,
    stride_wn,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_P2: tl.constexpr,
    USE_TMA: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # ---- tile list: each expert's rows in BLOCK_M-row tiles; (M-tile, N-tile) pairs, N fastest
    bins = tl.arange(0, E_P2)
    counts = tl.load(counts_ptr + bins, mask=bins < E, other=0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, axis=0)
    starts = tl.cumsum(counts, axis=0) - counts
    num_n = tl.cdiv(I, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    for t in tl.range(tl.program_id(0), tl.sum(tiles, axis=0) * num_n, num_programs):
        m_tile = t // num_n
        n0 = (t % num_n) * BLOCK_N
        before = tile_ends <= m_tile  # experts whose tiles all come before this one
        e = tl.sum(before.to(tl.int32), axis=0)
        start = tl.sum(tl.where(bins == e, starts, 0), axis=0)
        row_end = start + tl.sum(tl.where(bins == e, counts, 0), axis=0)
        row0 = start + (m_tile - tl.sum(tl.where(before, tiles, 0), axis=0)) * BLOCK_M
        rows = row0 + rm
        cols = n0 + rn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            # Rows past the expert's end read the next expert's rows (or zeros past the tensor) and
            # columns past I read the up half: neither is stored. On the TMA path H % BLOCK_K == 0.
            if USE_TMA:
                a = x_desc.load([row0, k0])
                bg = w_desc.load([e * 2 * I + n0, k0]).T
                bu = w_desc.load([e * 2 * I + I + n0, k0]).T
            else:
                ks = k0 + rk
                a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * H + ks[None, :],
                            mask=(rows < row_end)[:, None] & (ks < H)[None, :], other=0.0)
                w_e = w_ptr + e.to(tl.int64) * stride_we + ks[:, None]
                b_mask = (cols < I)[None, :] & (ks < H)[:, None]
                bg = tl.load(w_e + cols[None, :] * stride_wn, mask=b_mask, other=0.0)
                bu = tl.load(w_e + (I + cols)[None, :] * stride_wn, mask=b_mask, other=0.0)
            if INTERPRET:  # bf16 tl.dot is wrong in the triton 3.6 interpreter, and its tf32 rounds
                a = a.to(tl.float32)
                acc_g = tl.dot(a, bg.to(tl.float32), acc_g, input_precision="ieee")
                acc_u = tl.dot(a, bu.to(tl.float32), acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, bg, acc_g)
                acc_u = tl.dot(a, bu, acc_u)
        # ---- epilogue: h rounded once; aw from the rounded gate and up, as the unfused pass does
        mask = (rows < row_end)[:, None] & (cols < I)[None, :]
        h_row = h_ptr + rows.to(tl.int64)[:, None] * (2 * I)
        gate = acc_g.to(h_ptr.dtype.element_ty)
        up = acc_u.to(h_ptr.dtype.element_ty)
        tl.store(h_row + cols[None, :], gate, mask=mask)
        tl.store(h_row + I + cols[None, :], up, mask=mask)
        src = tl.load(order_ptr + rows, mask=rows < row_end, other=0)
        w = tl.load(rw_ptr + src, mask=rows < row_end, other=0.0).to(tl.float32)[:, None]
        g32 = gate.to(tl.float32)
        aw = w * (g32 * tl.sigmoid(g32) * up.to(tl.float32))
        tl.store(aw_ptr + rows.to(tl.int64)[:, None] * I + cols[None, :], aw.to(aw_ptr.dtype.element_ty), mask=mask)


@lazy_jit
def _dgrad_dswiglu_kernel(
    dy_ptr,  # [R, H] rows sorted by expert (dy of each row's token)
    dy_desc,  # blocks [BLOCK_M, BLOCK_K] (USE_TMA only)
    w_ptr,  # [E, H, I]
    w_desc,  # [E * H, I] view, blocks [BLOCK_K, BLOCK_N] (USE_TMA only)
    h_ptr,  # [R, 2I] the forward's gate | up
    h_desc,  # blocks [BLOCK_M, BLOCK_N // 2] (TMA_EPILOGUE only)
    dh_ptr,  # [R, 2I] out
    dh_desc,  # blocks [BLOCK_M, BLOCK_N // 2] (TMA_EPILOGUE only)
    part_ptr,  # [cdiv(I, BLOCK_N), R] fp32 out: per N-tile sum of g * silu(gate) * up
    rw_ptr,  # [T * k] routing weights, by row
    order_ptr,  # [R] int32
    counts_ptr,  # [E] int32
    R,
    I,
    H,
    E,
    stride_we,
    stride_wh,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_P2: tl.constexpr,
    USE_TMA: tl.constexpr,
    TMA_EPILOGUE: tl.constexpr,  # h and whole-tile d_h through descriptors (needs I % BLOCK_N == 0)
    INTERPRET: tl.constexpr,
):
    # ---- tile list: as in _gate_up_swiglu_kernel (lazy_jit kernels cannot share a jitted helper)
    bins = tl.arange(0, E_P2)
    counts = tl.load(counts_ptr + bins, mask=bins < E, other=0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, axis=0)
    starts = tl.cumsum(counts, axis=0) - counts
    num_n = tl.cdiv(I, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    HALF: tl.constexpr = BLOCK_N // 2
    rh = tl.arange(0, HALF)
    for t in tl.range(tl.program_id(0), tl.sum(tiles, axis=0) * num_n, num_programs):
        m_tile = t // num_n
        n_tile = t % num_n
        n0 = n_tile * BLOCK_N
        before = tile_ends <= m_tile
        e = tl.sum(before.to(tl.int32), axis=0)
        start = tl.sum(tl.where(bins == e, starts, 0), axis=0)
        row_end = start + tl.sum(tl.where(bins == e, counts, 0), axis=0)
        row0 = start + (m_tile - tl.sum(tl.where(before, tiles, 0), axis=0)) * BLOCK_M
        rows = row0 + rm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if USE_TMA:
                a = dy_desc.load([row0, k0])
                b = w_desc.load([e * H + k0, n0])
            else:
                ks = k0 + rk
                cols = n0 + tl.arange(0, BLOCK_N)
                a = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * H + ks[None, :],
                            mask=(rows < row_end)[:, None] & (ks < H)[None, :], other=0.0)
                b = tl.load(w_ptr + e.to(tl.int64) * stride_we + ks[:, None] * stride_wh + cols[None, :],
                            mask=(ks < H)[:, None] & (cols < I)[None, :], other=0.0)
            if INTERPRET:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        # ---- epilogue in two column halves: the whole tile's g, gate and up in fp32 at once would
        # not fit in registers.
        valid = rows < row_end
        src = tl.load(order_ptr + rows, mask=valid, other=0)
        w = tl.load(rw_ptr + src, mask=valid, other=0.0).to(tl.float32)[:, None]
        h_row = h_ptr + rows.to(tl.int64)[:, None] * (2 * I)
        dh_row = dh_ptr + rows.to(tl.int64)[:, None] * (2 * I)
        g_lo, g_hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        part = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for j in tl.static_range(2):
            if j == 0:
                g = g_lo
            else:
                g = g_hi
            c0 = n0 + j * HALF
            cols = c0 + rh
            mask = valid[:, None] & (cols < I)[None, :]
            g = g.to(dh_ptr.dtype.element_ty).to(tl.float32)  # the unfused path stores g in bf16
            if TMA_EPILOGUE:
                # Rows past the expert's end hold the next expert's h: masked out of the sum below
                # and never stored.
                gate = h_desc.load([row0, c0]).to(tl.float32)
                up = h_desc.load([row0, I + c0]).to(tl.float32)
            else:
                gate = tl.load(h_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                up = tl.load(h_row + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gate)
            act = gate * sig  # silu(gate)
            part += tl.sum(tl.where(mask, g * (act * up), 0.0), axis=1)
            d_a = w * g
            d_gate = (d_a * up * sig * (1.0 + gate * (1.0 - sig))).to(dh_ptr.dtype.element_ty)
            d_up = (d_a * act).to(dh_ptr.dtype.element_ty)
            if TMA_EPILOGUE and row0 + BLOCK_M <= row_end:
                dh_desc.store([row0, c0], d_gate)
                dh_desc.store([row0, I + c0], d_up)
            else:
                tl.store(dh_row + cols[None, :], d_gate, mask=mask)
                tl.store(dh_row + I + cols[None, :], d_up, mask=mask)
        tl.store(part_ptr + n_tile.to(tl.int64) * R + rows, part, mask=valid)


def _tma_ok(t: torch.Tensor) -> bool:
    # A descriptor needs a contiguous tensor, a 16-byte aligned base and 16-byte aligned rows.
    return t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0


def _programs(device: torch.device, tiles_bound: int) -> int:
    # Persistent: one program per SM (each needs ~150 KB of shared memory); the interpreter runs
    # one program per tile.
    if device.type != "cuda" or interpreting():
        return tiles_bound
    return min(tiles_bound, torch.cuda.get_device_properties(device).multi_processor_count)


def gate_up_swiglu(xs: torch.Tensor, w_gate_up: torch.Tensor, routing: Routing, rw: torch.Tensor, *,
                   config: SortedGemmConfig | None = None):
    """(h [S, 2I], aw [S, I]) for the sorted rows xs [S, H]; rw [T * k] the routing weights by row.

    h = xs @ W_gate_up[e]^T, aw = rw[row] * silu(gate) * up, both in the weights' dtype.
    Rows past offsets[E] are not written.
    """
    S, H = xs.shape
    E, two_i, _ = w_gate_up.shape
    I = two_i // 2
    h = torch.empty(S, two_i, dtype=w_gate_up.dtype, device=xs.device)
    aw = torch.empty(S, I, dtype=w_gate_up.dtype, device=xs.device)
    if S == 0:
        return h, aw
    cfg = INTERPRETER_CONFIG if interpreting() else (config or GATE_UP_CONFIG)
    use_tma = not interpreting() and H % cfg.block_k == 0 and _tma_ok(xs) and _tma_ok(w_gate_up)
    x_desc = TensorDescriptor.from_tensor(xs, [cfg.block_m, cfg.block_k]) if use_tma else None
    w_desc = TensorDescriptor.from_tensor(w_gate_up.view(E * two_i, H), [cfg.block_n, cfg.block_k]) if use_tma else None
    num_programs = _programs(xs.device, (cdiv(S, cfg.block_m) + E) * cdiv(I, cfg.block_n))
    _gate_up_swiglu_kernel[(num_programs,)](
        xs, x_desc, w_gate_up, w_desc, h, aw, rw, routing.order, routing.counts,
        I, H, E, w_gate_up.stride(0), w_gate_up.stride(1), num_programs,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, E_P2=next_power_of_2(E),
        USE_TMA=use_tma, INTERPRET=interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return h, aw


def dgrad_dswiglu(dys: torch.Tensor, w_down: torch.Tensor, h: torch.Tensor, routing: Routing, rw: torch.Tensor, *,
                  config: SortedGemmConfig | None = None):
    """(d_h [S, 2I], partials [n, S] fp32) for the sorted rows dys [S, H] and the forward's h.

    g = dys @ W_down[e] stays in registers. d_h = dSwiGLU(w * g) in the weights' dtype, and
    partials[j, p] = the sum of g * silu(gate) * up over N-tile j's columns of row p. Sum them in
    order with ``backward.d_weights_by_row``. Rows past offsets[E] are not written.
    """
    S, H = dys.shape
    E, _, I = w_down.shape
    cfg = INTERPRETER_CONFIG if interpreting() else (config or DGRAD_CONFIG)
    num_n = cdiv(I, cfg.block_n)
    dh = torch.empty(S, 2 * I, dtype=w_down.dtype, device=dys.device)
    part = torch.empty(num_n, S, dtype=torch.float32, device=dys.device)
    if S == 0:
        return dh, part
    use_tma = not interpreting() and H % cfg.block_k == 0 and _tma_ok(dys) and _tma_ok(w_down)
    dy_desc = TensorDescriptor.from_tensor(dys, [cfg.block_m, cfg.block_k]) if use_tma else None
    w_desc = TensorDescriptor.from_tensor(w_down.view(E * H, I), [cfg.block_k, cfg.block_n]) if use_tma else None
    tma_epilogue = use_tma and cfg.tma_epilogue and I % cfg.block_n == 0 and _tma_ok(h)
    h_desc = TensorDescriptor.from_tensor(h, [cfg.block_m, cfg.block_n // 2]) if tma_epilogue else None
    dh_desc = TensorDescriptor.from_tensor(dh, [cfg.block_m, cfg.block_n // 2]) if tma_epilogue else None
    num_programs = _programs(dys.device, (cdiv(S, cfg.block_m) + E) * num_n)
    _dgrad_dswiglu_kernel[(num_programs,)](
        dys, dy_desc, w_down, w_desc, h, h_desc, dh, dh_desc, part, rw, routing.order, routing.counts,
        S, I, H, E, w_down.stride(0), w_down.stride(1), num_programs,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, E_P2=next_power_of_2(E),
        USE_TMA=use_tma, TMA_EPILOGUE=tma_epilogue, INTERPRET=interpreting(), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return dh, part


__all__ = ["DGRAD_CONFIG", "GATE_UP_CONFIG", "SortedGemmConfig", "dgrad_dswiglu", "gate_up_swiglu"]
