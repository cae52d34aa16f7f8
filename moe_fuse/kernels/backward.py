"""The experts block backward from Triton kernels: same result as ``reference.experts_backward``.

A few GEMM launches and small passes, no atomics (bitwise repeatable), no host sync:

0. ``route`` again (three tiny launches): cheaper than saving the permutation.
1. dgrad, in one of two ways:
   - the forward kept h (``experts_forward(save_h=True)``, the training default): ``_dy_wdown_kernel``
     computes g = dy[tok] @ W_down[e] ([S, I], sorted order, K = H), then ``_dswiglu_kernel``, a
     bandwidth-bound pass over whole rows, writes
       d_h = dSwiGLU(weight * g)         [S, 2I] gate | up, weights' dtype
       aw  = weight * silu(gate) * up    [S, I]   (A operand of dW_down)
       d_weights = sum_i g * a           [S] by row, one fixed-order sum per row
     (with that epilogue inside the GEMM, the 128x128 tile spilled and ran at half speed);
   - h was not kept (activation checkpointing, where re-running the forward to rebuild h would
     cost more): ``_dgrad_kernel`` over [S, I] tiles feeds three accumulators from one K loop,
     g and the recomputed gate | up = x[tok] @ W_gate_up[e]^T, and its epilogue writes d_h, aw and
     per-N-tile partial sums of g * a that ``_dweights_kernel`` adds in tile order.
2. ``_dx_kernel``: d_h[p] @ W_gate_up[e] -> [S, H], each row written to its
   (token, slot) place; ``combine`` then sums the k slots in a fixed order (fp32).
3. the weight gradients, K = the expert's rows (zero rows: zeros):
     dW_down[e]    = dy[tok]^T @ aw     [H, I]
     dW_gate_up[e] = d_h^T @ x[tok]     [2I, H]
   ``_wgrad_kernel`` twice, one program per (expert, M-tile, N-tile), experts with the most rows
   first. dW_gate_up runs on a second stream beside dx and dW_down.

On CUDA sm90+ in bf16, ``dispatch.experts_backward`` runs grouped_mm_path.py instead: every GEMM
through ``torch._grouped_mm`` (CUTLASS) on gathered rows, with this module's dSwiGLU pass.

dx needs d_h, which needs the whole dgrad row block, so steps 1 and 2 cannot share a program:
d_h makes one round trip through memory ([S, 2I], weights' dtype), as in any unfused backward.

GEMM operands are the weights' dtype (dy and x are cast to it, as the forward casts x),
accumulation is fp32; g, h, d_h and aw are stored in the weights' dtype, which is where this
differs from the all-fp32 reference (a few 1e-3 relative in bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..reference import limit_in, softcaps
from ._jit import cdiv, interpreting, lazy_jit, next_power_of_2
from .combine import combine
from .forward import supports
from . import transposed
from .grouped_gemm import GemmConfig, _dot_precision, _m_tiles_bound, _tma_ok, default_config
from .jit_math import clamp_gate_up, dglu, gate_up_in_limit, glu_terms, load_gate_up
from .jit_tiles import expert_tile_counts, grouped_tile, tile_rows
from .routing import Routing, route

# --------------------------------------------------------------------------- kernels


@lazy_jit
def _dgrad_kernel(
    dy_ptr,  # [T, H] contiguous
    x_ptr,  # [T, H] strided
    order_ptr,  # [S] int32, sorted position -> row
    counts_ptr,  # [E] int32
    rw_ptr,  # [S] routing weights, by row
    wgu_ptr,  # [E, 2I, H]
    wgu_desc,  # [E * 2I, H] view, blocks [BLOCK_N, BLOCK_K] (USE_TMA only)
    wd_ptr,  # [E, H, I]
    wd_desc,  # [E * H, I] view, blocks [BLOCK_K, BLOCK_N] (USE_TMA only)
    dh_ptr,  # [S, 2I] out, sorted order
    aw_ptr,  # [S, I] out, sorted order
    part_ptr,  # [num_n_tiles, S] fp32 out: sum over the tile's columns of g * a
    S,
    H,
    I,
    E,
    num_m_tiles,
    stride_xt,
    stride_xh,
    stride_gue,
    stride_gun,
    stride_guh,
    stride_wde,
    stride_wdh,
    stride_wdi,
    limit,  # swiglu_limit in the weights' dtype (LIMITED)
    alpha,  # glu_alpha (ALPHA_GATE)
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_P2: tl.constexpr,
    EVEN_K: tl.constexpr,
    LIMITED: tl.constexpr,  # gate.clamp(max=limit), up.clamp(-limit, limit) before SwiGLU
    ALPHA_GATE: tl.constexpr,  # gate * sigmoid(alpha * gate) * (up + 1) instead of silu(gate) * up
    GELU_TANH: tl.constexpr,  # gelu(gate, approximate="tanh") * up (GeGLU) instead of silu(gate) * up
    USE_TMA: tl.constexpr,
    INTERPRET: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # ---- program -> (M-tile, N-tile) -> expert and rows (jit_tiles.py)
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_m_tiles, tl.cdiv(I, BLOCK_N), GROUP_M)
    bins, counts, tiles = expert_tile_counts(counts_ptr, E, BLOCK_M, E_P2)
    if pid_m >= tl.sum(tiles, axis=0):
        return
    expert, tile_in_expert, row_begin, m, row_valid = tile_rows(bins, counts, tiles, pid_m, BLOCK_M)
    pos = row_begin + m
    src = tl.load(order_ptr + pos, mask=row_valid, other=0)
    token = (src // TOP_K).to(tl.int64)  # rows past the expert's end read token 0: never stored

    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past I: W_gate^T tiles clamp their (strided) column index, the W_down tile masks its
    # contiguous one (a clamp there would hide the contiguity and lose vectorised, pipelined loads).
    # Neither is stored, and both are masked out of the row sums.
    n_load = tl.minimum(n, I - 1)
    n_in = (n < I)[None, :]
    kk = tl.arange(0, BLOCK_K)
    dy_ptrs = dy_ptr + token[:, None] * H + kk[None, :]
    x_ptrs = x_ptr + token[:, None] * stride_xt + kk[None, :] * stride_xh
    e64 = expert.to(tl.int64)
    # W_down[e] tile [K, N] and W_gate[e]^T tile [K, N]
    d_ptrs = wd_ptr + e64 * stride_wde + kk[:, None] * stride_wdh + n[None, :] * stride_wdi
    g_ptrs = wgu_ptr + e64 * stride_gue + n_load[None, :] * stride_gun + kk[:, None] * stride_guh
    up_offset = I * stride_gun
    gate_row = expert * (2 * I) + pid_n * BLOCK_N  # USE_TMA: row of the [E * 2I, H] view
    down_row = expert * H  # USE_TMA: row of the [E * H, I] view; a K tail reads the next expert times dy's zeros

    w_dtype = wgu_ptr.dtype.element_ty
    acc_d = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            a_dy = tl.load(dy_ptrs)
            a_x = tl.load(x_ptrs)
        else:
            k_row = ((k0 + kk) < H)[None, :]
            a_dy = tl.load(dy_ptrs, mask=k_row, other=0.0)
            a_x = tl.load(x_ptrs, mask=k_row, other=0.0)
        if USE_TMA:
            bd = wd_desc.load([down_row + k0, pid_n * BLOCK_N])
            bg = wgu_desc.load([gate_row, k0]).T
            bu = wgu_desc.load([gate_row + I, k0]).T
        elif EVEN_K:
            bd = tl.load(d_ptrs, mask=n_in, other=0.0)
            bg = tl.load(g_ptrs)
            bu = tl.load(g_ptrs + up_offset)
        else:
            k_col = ((k0 + kk) < H)[:, None]
            bd = tl.load(d_ptrs, mask=k_col & n_in, other=0.0)
            bg = tl.load(g_ptrs, mask=k_col, other=0.0)
            bu = tl.load(g_ptrs + up_offset, mask=k_col, other=0.0)
        a_dy = a_dy.to(w_dtype)
        a_x = a_x.to(w_dtype)
        if INTERPRET:  # bf16 tl.dot is wrong in the triton 3.6 interpreter
            a_dy = a_dy.to(tl.float32)
            a_x = a_x.to(tl.float32)
            bd = bd.to(tl.float32)
            bg = bg.to(tl.float32)
            bu = bu.to(tl.float32)
        acc_d = tl.dot(a_dy, bd, acc_d, input_precision=DOT_PRECISION)
        acc_g = tl.dot(a_x, bg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a_x, bu, acc_u, input_precision=DOT_PRECISION)
        dy_ptrs += BLOCK_K
        x_ptrs += BLOCK_K * stride_xh
        d_ptrs += BLOCK_K * stride_wdh
        g_ptrs += BLOCK_K * stride_guh

    # ---- epilogue, fp32: SwiGLU recomputed, its backward, the routing-weight gradient's partial sum
    rw = tl.load(rw_ptr + src, mask=row_valid, other=0.0).to(tl.float32)[:, None]
    if LIMITED:  # clamp h as the forward stored it (rounded); a clamped value passes no gradient
        acc_g = acc_g.to(dh_ptr.dtype.element_ty).to(tl.float32)
        acc_u = acc_u.to(dh_ptr.dtype.element_ty).to(tl.float32)
        g_in, u_in = gate_up_in_limit(acc_g, acc_u, limit)
        acc_g, acc_u = clamp_gate_up(acc_g, acc_u, limit)
    sig, act, up_term, tg, tu = glu_terms(acc_g, acc_u, alpha, 1.0, 1.0, ALPHA_GATE, GELU_TANH, False)
    a = act * up_term
    partial = tl.sum(tl.where(n_in, acc_d * a, 0.0), axis=1)
    d_gate, d_up = dglu(rw * acc_d, acc_g, acc_u, sig, act, up_term, tg, tu, alpha, ALPHA_GATE, GELU_TANH, False)
    if LIMITED:
        d_gate = tl.where(g_in, d_gate, 0.0)
        d_up = tl.where(u_in, d_up, 0.0)

    out_mask = row_valid[:, None] & n_in
    pos64 = pos.to(tl.int64)
    dh_ptrs = dh_ptr + pos64[:, None] * (2 * I) + n[None, :]
    tl.store(dh_ptrs, d_gate.to(dh_ptr.dtype.element_ty), mask=out_mask)
    tl.store(dh_ptrs + I, d_up.to(dh_ptr.dtype.element_ty), mask=out_mask)
    tl.store(aw_ptr + pos64[:, None] * I + n[None, :], (rw * a).to(aw_ptr.dtype.element_ty), mask=out_mask)
    tl.store(part_ptr + pid_n.to(tl.int64) * S + pos64, partial, mask=row_valid)


@lazy_jit
def _dy_wdown_kernel(
    dy_ptr,  # [T, H] contiguous
    order_ptr,  # [S] int32, sorted position -> row
    counts_ptr,  # [E] int32
    wd_ptr,  # [E, H, I]
    wd_desc,  # [E * H, I] view, blocks [BLOCK_K, BLOCK_N] (USE_TMA only)
    g_ptr,  # [S, I] out, sorted order: g = dy[tok] @ W_down[e]
    H,
    I,
    E,
    num_m_tiles,
    stride_wde,
    stride_wdh,
    stride_wdi,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_P2: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr,
    INTERPRET: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The dgrad GEMM alone, when the forward kept h: g = dy[tok] @ W_down[e], stored as is.

    With the dSwiGLU epilogue in this kernel (read h, write d_h and aw) the 128x128 tile spilled
    (ptxas, sm_90a) and ran at 2x its main loop's time; ``_dswiglu_kernel`` does that part as a
    bandwidth-bound pass instead (docs/kernels.md, docs/performance.md).
    """
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_m_tiles, tl.cdiv(I, BLOCK_N), GROUP_M)
    bins, counts, tiles = expert_tile_counts(counts_ptr, E, BLOCK_M, E_P2)
    if pid_m >= tl.sum(tiles, axis=0):
        return
    expert, tile_in_expert, row_begin, m, row_valid = tile_rows(bins, counts, tiles, pid_m, BLOCK_M)
    pos = row_begin + m
    src = tl.load(order_ptr + pos, mask=row_valid, other=0)
    token = (src // TOP_K).to(tl.int64)  # rows past the expert's end read token 0: never stored

    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = (n < I)[None, :]  # a mask, not a clamp: the contiguous dimension of the W_down tile
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = dy_ptr + token[:, None] * H + kk[None, :]
    b_ptrs = wd_ptr + expert.to(tl.int64) * stride_wde + kk[:, None] * stride_wdh + n[None, :] * stride_wdi
    down_row = expert * H  # USE_TMA: a K tail reads the next expert's rows times dy's zeros

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=((k0 + kk) < H)[None, :], other=0.0)
        if USE_TMA:
            b = wd_desc.load([down_row + k0, pid_n * BLOCK_N])
        elif EVEN_K:
            b = tl.load(b_ptrs, mask=n_in, other=0.0)
        else:
            b = tl.load(b_ptrs, mask=((k0 + kk) < H)[:, None] & n_in, other=0.0)
        a = a.to(wd_ptr.dtype.element_ty)
        if INTERPRET:  # bf16 tl.dot is wrong in the triton 3.6 interpreter
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wdh

    out_mask = row_valid[:, None] & n_in
    tl.store(g_ptr + pos.to(tl.int64)[:, None] * I + n[None, :], acc.to(g_ptr.dtype.element_ty), mask=out_mask)


@lazy_jit
def _dswiglu_kernel(
    g_ptr,  # [S, I] sorted order
    h_ptr,  # [S, 2I] sorted order: the forward's gate | up
    rw_ptr,  # [S] routing weights, by row
    order_ptr,  # [S] int32
    offsets_ptr,  # [E + 1] int32; offsets[E] = routed rows
    dh_ptr,  # [S, 2I] out, sorted order
    aw_ptr,  # [S, I] out, sorted order (WRITE_AW)
    dw_ptr,  # [S] out, by row: d_weights = sum_i g * silu(gate) * up
    bias_ptr,  # [E, 2I] gate_up bias, h's column order (HAS_BIAS)
    ids_ptr,  # [T * k] expert of each row (HAS_BIAS)
    S,
    I,
    E,
    limit,  # swiglu_limit in h's dtype (LIMITED)
    alpha,  # glu_alpha (ALPHA_GATE)
    gate_cap,  # softcap of the gate's linear factor (SOFTCAP)
    up_cap,  # softcap of up (SOFTCAP)
    LIMITED: tl.constexpr,  # gate.clamp(max=limit), up.clamp(-limit, limit) before SwiGLU
    ALPHA_GATE: tl.constexpr,  # gate * sigmoid(alpha * gate) * (up + 1) instead of silu(gate) * up
    GELU_TANH: tl.constexpr,  # gelu(gate, approximate="tanh") * up (GeGLU) instead of silu(gate) * up
    SOFTCAP: tl.constexpr,  # softcap(gate) * sigmoid(gate) * softcap(up), softcap(v) = cap * tanh(v / cap)
    WRITE_AW: tl.constexpr,  # False: the forward kept aw (grouped_mm_path), skip the [S, I] store
    HAS_BIAS: tl.constexpr,  # h + bias[e] first (in fp32)
    INTERLEAVED: tl.constexpr,  # gate, up = h's even, odd columns (GPT-OSS); d_h written so too
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """Per routed row p (sorted order): d_h = dSwiGLU(w * g), aw = w * a, d_weights = sum(g * a); fp32 math.

    Whole rows per program, so the d_weights row sum is one fixed-order reduction (no partials).
    Sentinel rows (past offsets[E]) get d_weights = 0 and nothing else.
    """
    p = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_s = p < S
    routed = p < tl.load(offsets_ptr + E)
    src = tl.load(order_ptr + p, mask=in_s, other=0)
    w = tl.load(rw_ptr + src, mask=routed, other=0.0).to(tl.float32)[:, None]
    p64 = p.to(tl.int64)[:, None]
    e64 = p64  # each row's expert with HAS_BIAS; not read without
    if HAS_BIAS:
        e64 = tl.load(ids_ptr + src, mask=routed, other=0).to(tl.int64)[:, None]
    dw = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for i0 in range(0, I, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        mask = routed[:, None] & (i < I)[None, :]
        g = tl.load(g_ptr + p64 * I + i[None, :], mask=mask, other=0.0).to(tl.float32)
        gate, up = load_gate_up(h_ptr, bias_ptr, p64, e64, i0, i, I, routed, mask, HAS_BIAS, INTERLEAVED, BLOCK_R,
                                BLOCK_I)
        if LIMITED:  # a clamped value passes no gradient
            g_in, u_in = gate_up_in_limit(gate, up, limit)
            gate, up = clamp_gate_up(gate, up, limit)
        sig, act, up_term, tg, tu = glu_terms(gate, up, alpha, gate_cap, up_cap, ALPHA_GATE, GELU_TANH, SOFTCAP)
        a = act * up_term
        dw += tl.sum(g * a, axis=1)
        d_gate, d_up = dglu(w * g, gate, up, sig, act, up_term, tg, tu, alpha, ALPHA_GATE, GELU_TANH, SOFTCAP)
        if LIMITED:
            d_gate = tl.where(g_in, d_gate, 0.0)
            d_up = tl.where(u_in, d_up, 0.0)
        if INTERLEAVED:  # the chunk's columns of d_h, as load_gate_up read h's
            c = 2 * i0 + tl.arange(0, 2 * BLOCK_I)
            pmask = routed[:, None] & (c < 2 * I)[None, :]
            d_pair = tl.reshape(tl.join(d_gate, d_up), (BLOCK_R, 2 * BLOCK_I))
            tl.store(dh_ptr + p64 * (2 * I) + c[None, :], d_pair.to(dh_ptr.dtype.element_ty), mask=pmask)
        else:
            tl.store(dh_ptr + p64 * (2 * I) + i[None, :], d_gate.to(dh_ptr.dtype.element_ty), mask=mask)
            tl.store(dh_ptr + p64 * (2 * I) + I + i[None, :], d_up.to(dh_ptr.dtype.element_ty), mask=mask)
        if WRITE_AW:
            tl.store(aw_ptr + p64 * I + i[None, :], (w * a).to(aw_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + src, dw.to(dw_ptr.dtype.element_ty), mask=in_s)


@lazy_jit
def _dx_kernel(
    dh_ptr,  # [S, 2I] sorted order
    dh_desc,  # blocks [BLOCK_M, BLOCK_K] (USE_TMA only)
    order_ptr,  # [S] int32
    counts_ptr,  # [E] int32
    wgu_ptr,  # [E, 2I, H]
    wgu_desc,  # [E * 2I, H] view, blocks [BLOCK_K, BLOCK_N] (USE_TMA only)
    out_ptr,  # [S, H] out, by row (= [T, k, H])
    H,
    I,
    E,
    num_m_tiles,
    stride_gue,
    stride_gun,
    stride_guh,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_P2: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr,
    INTERPRET: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_m_tiles, tl.cdiv(H, BLOCK_N), GROUP_M)
    bins, counts, tiles = expert_tile_counts(counts_ptr, E, BLOCK_M, E_P2)
    if pid_m >= tl.sum(tiles, axis=0):
        return
    expert, tile_in_expert, row_begin, m, row_valid = tile_rows(bins, counts, tiles, pid_m, BLOCK_M)
    pos = row_begin + tl.where(row_valid, m, 0)  # invalid rows re-read the expert's first row
    src = tl.load(order_ptr + pos)

    two_i = 2 * I
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = (n < H)[None, :]  # a mask, not a clamp: H is the contiguous dimension of the W tile
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = dh_ptr + pos.to(tl.int64)[:, None] * two_i + kk[None, :]
    b_ptrs = wgu_ptr + expert.to(tl.int64) * stride_gue + kk[:, None] * stride_gun + n[None, :] * stride_guh
    a_row = row_begin + tile_in_expert * BLOCK_M  # USE_TMA
    w_row = expert * two_i  # USE_TMA; a K tail reads the next expert's rows times d_h's zero columns

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, two_i, BLOCK_K):
        if USE_TMA:
            a = dh_desc.load([a_row, k0])
            b = wgu_desc.load([w_row + k0, pid_n * BLOCK_N])
        elif EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, mask=n_in, other=0.0)
        else:
            k_ok = (k0 + kk) < two_i
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_in, other=0.0)
        if INTERPRET:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_gun

    out_mask = row_valid[:, None] & n_in
    tl.store(out_ptr + src.to(tl.int64)[:, None] * H + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@lazy_jit
def _wgrad_kernel(
    l_ptr,  # rows of the left operand (its columns are the output's M)
    r_ptr,  # rows of the right operand (its columns are the output's N)
    order_ptr,  # [S] int32
    offsets_ptr,  # [E + 1] int32
    experts_ptr,  # [E] int32: experts by decreasing row count (the longest reductions start first)
    out_ptr,  # [E, M, N] contiguous, out
    M,
    N,
    num_m_tiles,
    num_n_tiles,
    stride_lr,
    stride_lc,
    stride_rr,
    stride_rc,
    TOP_K: tl.constexpr,
    L_GATHER: tl.constexpr,  # row of p is token(p) (True) or p itself (False)
    R_GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    INTERPRET: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[e] = L[rows of e]^T @ R[rows of e]: a GEMM whose reduction runs over the expert's rows."""
    pid = tl.program_id(0)
    per_expert = num_m_tiles * num_n_tiles
    expert = tl.load(experts_ptr + pid // per_expert)
    pid_m, pid_n = grouped_tile(pid % per_expert, num_m_tiles, num_n_tiles, GROUP_M)

    row_begin = tl.load(offsets_ptr + expert)
    row_count = tl.load(offsets_ptr + expert + 1) - row_begin

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Masks, not clamps, on the columns: they are the contiguous dimension of both operands.
    m_in = (m < M)[None, :]
    n_in = (n < N)[None, :]
    kk = tl.arange(0, BLOCK_K)
    out_dtype = out_ptr.dtype.element_ty

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, row_count, BLOCK_K):
        k_ok = (k0 + kk) < row_count
        pos = row_begin + k0 + kk
        token = (tl.load(order_ptr + pos, mask=k_ok, other=0) // TOP_K).to(tl.int64)  # unused when neither gathers
        if L_GATHER:
            l_rows = token
        else:
            l_rows = pos.to(tl.int64)
        if R_GATHER:
            r_rows = token
        else:
            r_rows = pos.to(tl.int64)
        # Rows past the expert's end belong to the next expert: both operands read zeros there.
        lt = tl.load(l_ptr + l_rows[:, None] * stride_lr + m[None, :] * stride_lc, mask=k_ok[:, None] & m_in, other=0.0)
        rt = tl.load(r_ptr + r_rows[:, None] * stride_rr + n[None, :] * stride_rc, mask=k_ok[:, None] & n_in, other=0.0)
        lt = lt.to(out_dtype)
        rt = rt.to(out_dtype)
        if INTERPRET:
            lt = lt.to(tl.float32)
            rt = rt.to(tl.float32)
        acc = tl.dot(tl.trans(lt), rt, acc, input_precision=DOT_PRECISION)

    out_mask = (m < M)[:, None] & n_in
    out_ptrs = out_ptr + expert.to(tl.int64) * M * N + m.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(out_ptrs, acc.to(out_dtype), mask=out_mask)


@lazy_jit
def _dweights_kernel(
    part_ptr,  # [num_parts, S] fp32, sorted order
    order_ptr,  # [S] int32
    offsets_ptr,  # [E + 1] int32; offsets[E] = routed rows
    out_ptr,  # [S] by row (= [T, k]) out
    S,
    E,
    num_parts,
    BLOCK: tl.constexpr,
):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = p < S
    routed = p < tl.load(offsets_ptr + E)  # sentinel rows sort last and get zero
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(num_parts):  # fixed order: bitwise repeatable
        acc += tl.load(part_ptr + j * S + p, mask=valid & routed, other=0.0)
    row = tl.load(order_ptr + p, mask=valid, other=0)
    tl.store(out_ptr + row, acc.to(out_ptr.dtype.element_ty), mask=valid)


# --------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class BackwardConfig:
    dgrad: GemmConfig  # [S, I] tiles, K = H (three accumulators when recomputing h, one when reading it)
    dx: GemmConfig  # [S, H] tiles, K = 2I
    wgrad: GemmConfig  # per expert [2I, H] tiles of dW_gate_up (and dW_down's unless set below), K = the expert's rows
    wgrad_down: GemmConfig | None = None  # per expert [H, I] tiles of dW_down


INTERPRETER_BACKWARD_CONFIG = BackwardConfig(
    GemmConfig(16, 32, 32, 1, 4, 1), GemmConfig(16, 32, 32, 1, 4, 1), GemmConfig(32, 32, 16, 1, 4, 1)
)


def default_backward_config(
    S: int, E: int, H: int, I: int, dtype: torch.dtype, *, saved_h: bool = False
) -> BackwardConfig:
    """Block shapes from the average rows per expert (a bucket of S / E, so new batch sizes compile nothing new).

    ``saved_h``: the dgrad reads the forward's h (one accumulator) instead of recomputing it (three).
    Large-batch shapes: see docs/kernels.md, docs/performance.md (backward section) for the H200 sweep.
    """
    if interpreting():
        return INTERPRETER_BACKWARD_CONFIG
    rows = S / max(E, 1)
    wide = dtype != torch.float32
    bk = 64 if wide else 32
    # dx has the forward down GEMM's shape family ([S, N] tiles, a K loop over the weights).
    dx = default_config("down", S, E, H, 2 * I, dtype)
    if saved_h:
        # A plain GEMM over K = H with [S, N] tiles: the forward down GEMM's shape family.
        dgrad = default_config("down", S, E, I, H, dtype)
        return BackwardConfig(dgrad, dx, _wgrad_config(S, E, dtype, "gate_up"), _wgrad_config(S, E, dtype, "down"))
    if not wide:
        # fp32 (tf32 dots) holds more in registers: larger dgrad tiles spill (ptxas, sm_90a). Not a speed target.
        dgrad = GemmConfig(32, 32, 64, 1, 4, 3)
    elif rows <= 16:
        dgrad = GemmConfig(16, 32, 2 * bk, 1, 4, 4)  # decode: streaming the weights is the cost
    elif rows <= 48:
        dgrad = GemmConfig(32, 64, 2 * bk, 1, 4, 4)
    elif rows <= 160:
        dgrad = GemmConfig(64, 64, bk, 1, 4, 4)  # 64x128 (the forward's) spills here and overflows shared memory
    else:
        # H200, 30B layer, T=16384 (docs/kernels.md, docs/performance.md): three 128x128 accumulators at BK=32 spill
        # ~100 bytes (ptxas) and still beat 128x64 tiles by 13% (437 vs 382-408 TFLOP/s): half the
        # re-reads of the gathered dy and x rows. 128x128 at BK=64 (2 stages) lost 13%.
        dgrad = GemmConfig(128, 128, 32, 8, 8, 3, use_tma=True)
    return BackwardConfig(dgrad, dx, _wgrad_config(S, E, dtype, "gate_up"), _wgrad_config(S, E, dtype, "down"))


def _wgrad_config(S: int, E: int, dtype: torch.dtype, kind: str) -> GemmConfig:
    """kind "gate_up": dW_gate_up [2I, H] per expert; "down": dW_down [H, I]."""
    if interpreting():
        return INTERPRETER_BACKWARD_CONFIG.wgrad
    bk = 64 if dtype != torch.float32 else 32
    rows = S / max(E, 1)
    if rows <= 160:
        # Short reductions: the cost is writing [M, N] per expert; smaller tiles, more programs.
        return GemmConfig(64, 128, bk, 4, 4, 3)
    if dtype == torch.float32:
        return GemmConfig(128, 128, bk, 8, 8, 3)
    if rows <= 512:
        # H200, 256 rows per expert (T=4096), bench/sweep_wgrad_gpu.py at da3be06: 128x128 tiles with a shallow
        # pipeline fit two programs per SM, so one's epilogue overlaps the other's loads: 9-18% faster
        # than the deep 256x128 / 128x256 ones on both layers (30B 0.773 -> 0.708 and 0.394 -> 0.333 ms).
        if kind == "down":
            return GemmConfig(128, 128, 64, 8, 4, 3)
        return GemmConfig(128, 128, 32, 8, 4, 4)
    # H200, 30B layer, T=16384 (docs/kernels.md, docs/performance.md): 2 x 128 x 128 tiles along the longer output
    # side with 5 stages beat 128x128x64 s3 by 8-9% on both (1.03 vs 1.13 ms, 2.05 vs 2.22 ms).
    if kind == "down":
        return GemmConfig(128, 256, bk, 8, 8, 5)
    return GemmConfig(256, 128, bk, 8, 8, 5)


# --------------------------------------------------------------------------- launchers


def dgrad_saved(dy, routing: Routing, rw, h, w_down, top_k: int, weights_dtype, *, config: GemmConfig | None = None,
                swiglu_limit: float | None = None, glu_alpha: float | None = None, activation: str = "silu"):
    """(d_h [S, 2I], aw [S, I], d_weights [S] by row): the dgrad when the forward kept h [S, 2I].

    Two launches: the GEMM g = dy[tok] @ W_down[e] ([S, I], weights' dtype), then the dSwiGLU pass.
    """
    E, H, I = w_down.shape
    S = routing.order.numel()
    cfg = config or default_backward_config(S, E, H, I, w_down.dtype, saved_h=True).dgrad
    g = torch.empty(S, I, dtype=w_down.dtype, device=dy.device)
    num_m = _m_tiles_bound(S, E, cfg.block_m)
    use_tma = cfg.use_tma and _tma_ok(w_down)
    wd_desc = TensorDescriptor.from_tensor(w_down.view(E * H, I), [cfg.block_k, cfg.block_n]) if use_tma else None
    _dy_wdown_kernel[(num_m * cdiv(I, cfg.block_n),)](
        dy,
        routing.order,
        routing.counts,
        w_down,
        wd_desc,
        g,
        H,
        I,
        E,
        num_m,
        *w_down.stride(),
        TOP_K=top_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        E_P2=next_power_of_2(E),
        EVEN_K=H % cfg.block_k == 0,
        USE_TMA=use_tma,
        INTERPRET=interpreting(),
        DOT_PRECISION=_dot_precision(w_down.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return dswiglu(g, h, rw, routing, weights_dtype, swiglu_limit=swiglu_limit, glu_alpha=glu_alpha,
                   activation=activation)


def bias_operands(gate_up_bias, ids, E: int, two_i: int, like):
    """(bias, ids by row) pointers for the SwiGLU passes: the gate_up bias [E, 2I] and the flat ids, checked; or
    ``like`` twice where there is no bias (never read)."""
    if gate_up_bias is None:
        return like, like
    if ids is None or tuple(gate_up_bias.shape) != (E, two_i):
        raise ValueError(f"gate_up_bias must be [E={E}, 2I={two_i}] with the ids of the rows, got "
                         f"{tuple(gate_up_bias.shape)}{'' if ids is not None else ' and no ids'}")
    return gate_up_bias.contiguous(), ids.reshape(-1).contiguous()


def dswiglu(g, h, rw, routing: Routing, weights_dtype, *, write_aw: bool = True, swiglu_limit: float | None = None,
            glu_alpha: float | None = None, activation: str = "silu", gate_up_bias=None, ids=None,
            interleaved: bool = False):
    """(d_h [S, 2I], aw [S, I] or None, d_weights [S] by row) from g = dy[tok] @ W_down[e] and the saved h,
    sorted order. write_aw False: aw is not computed (None), for a caller that kept the forward's.

    Rows past offsets[E] (sentinels): d_weights 0, d_h and aw not written. swiglu_limit: the forward clamped
    gate and up (``reference.clamp_gate_up``); glu_alpha, activation: its gate was ``reference.glu``'s with those.
    gate_up_bias [E, 2I] (with ids [T, k]): h is the GEMM's output, the bias added here again; interleaved: gate
    and up are h's even and odd columns, and d_h's.
    """
    S, I = g.shape
    limit = limit_in(h.dtype, swiglu_limit)
    dh = torch.empty(S, 2 * I, dtype=g.dtype, device=g.device)
    aw = torch.empty(S, I, dtype=g.dtype, device=g.device) if write_aw else None
    d_weights = torch.empty(S, dtype=weights_dtype, device=g.device)
    # 4 x 256: 244 us against 255 at 16 x 128 without aw (30B, T=16384, H200; the pass-config probe at da3be06).
    block_r = 4
    block_i = 32 if interpreting() else 256
    E = routing.counts.numel()
    bias, row_experts = bias_operands(gate_up_bias, ids, E, 2 * I, routing.order)
    caps = softcaps(activation)
    _dswiglu_kernel[(cdiv(S, block_r),)](
        g, h, rw, routing.order, routing.offsets, dh, aw if write_aw else dh, d_weights, bias, row_experts, S, I,
        E, 0.0 if limit is None else limit, 1.0 if glu_alpha is None else float(glu_alpha), *(caps or (1.0, 1.0)),
        LIMITED=limit is not None, ALPHA_GATE=glu_alpha is not None, GELU_TANH=activation == "gelu_tanh",
        SOFTCAP=caps is not None, WRITE_AW=write_aw, HAS_BIAS=gate_up_bias is not None, INTERLEAVED=interleaved,
        BLOCK_R=block_r, BLOCK_I=block_i, num_warps=4,
    )
    return dh, aw, d_weights


@lazy_jit
def _expert_sums_kernel(
    t_ptr,  # [S, N] sorted order
    offsets_ptr,  # [E + 1] int32
    out_ptr,  # [E, N] fp32 out
    N,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out[e] = the sum of t's rows offsets[e] .. offsets[e + 1], fp32, in one fixed order (no atomics)."""
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    lo = tl.load(offsets_ptr + e)
    hi = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for r0 in range(lo, hi, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        mask = (r < hi)[:, None] & (n < N)[None, :]
        acc += tl.load(t_ptr + r.to(tl.int64)[:, None] * N + n[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + e.to(tl.int64) * N + n, tl.sum(acc, axis=0), mask=n < N)


def expert_sums(t, routing: Routing, out_dtype):
    """[E, N] in out_dtype: each expert's rows of t [S, N] (sorted order) summed in fp32 (a bias gradient);
    zeros for an expert without rows; rows past offsets[E] (sentinels) are in no sum."""
    S, N = t.shape
    E = routing.counts.numel()
    out = torch.empty(E, N, dtype=torch.float32, device=t.device)
    block_r, block_n = (8, 16) if interpreting() else (32, 128)
    _expert_sums_kernel[(E, cdiv(N, block_n))](t, routing.offsets, out, N, BLOCK_R=block_r, BLOCK_N=block_n,
                                               num_warps=4)
    return out.to(out_dtype)


def dgrad(dy, x, routing: Routing, rw, w_gate_up, w_down, top_k: int, *, config: GemmConfig | None = None,
          swiglu_limit: float | None = None, glu_alpha: float | None = None, activation: str = "silu"):
    """(d_h [S, 2I], aw [S, I], partials [n_tiles, S] fp32), all in sorted order; see the module docstring.

    dy [T, H] contiguous, rw [S] the routing weights by row (contiguous); h is recomputed from x.
    """
    E, two_i, H = w_gate_up.shape
    I = two_i // 2
    S = routing.order.numel()
    cfg = config or default_backward_config(S, E, H, I, w_gate_up.dtype).dgrad
    limit = limit_in(w_gate_up.dtype, swiglu_limit)
    num_n = cdiv(I, cfg.block_n)
    dh = torch.empty(S, two_i, dtype=w_gate_up.dtype, device=x.device)
    aw = torch.empty(S, I, dtype=w_gate_up.dtype, device=x.device)
    part = torch.empty(num_n, S, dtype=torch.float32, device=x.device)
    num_m = _m_tiles_bound(S, E, cfg.block_m)
    use_tma = cfg.use_tma and _tma_ok(w_gate_up) and _tma_ok(w_down)
    gu_desc = None
    wd_desc = None
    if use_tma:
        gu_desc = TensorDescriptor.from_tensor(w_gate_up.view(E * two_i, H), [cfg.block_n, cfg.block_k])
        wd_desc = TensorDescriptor.from_tensor(w_down.view(E * H, I), [cfg.block_k, cfg.block_n])
    _dgrad_kernel[(num_m * num_n,)](
        dy,
        x,
        routing.order,
        routing.counts,
        rw,
        w_gate_up,
        gu_desc,
        w_down,
        wd_desc,
        dh,
        aw,
        part,
        S,
        H,
        I,
        E,
        num_m,
        x.stride(0),
        x.stride(1),
        *w_gate_up.stride(),
        *w_down.stride(),
        0.0 if limit is None else limit,
        1.0 if glu_alpha is None else float(glu_alpha),
        TOP_K=top_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        E_P2=next_power_of_2(E),
        EVEN_K=H % cfg.block_k == 0,
        LIMITED=limit is not None,
        ALPHA_GATE=glu_alpha is not None,
        GELU_TANH=activation == "gelu_tanh",
        USE_TMA=use_tma,
        INTERPRET=interpreting(),
        DOT_PRECISION=_dot_precision(w_gate_up.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return dh, aw, part


def dx_slots(dh, routing: Routing, w_gate_up, out_dtype, *, config: GemmConfig | None = None):
    """[S, H] by row (token * k + slot): d_h[p] @ W_gate_up[e]; sentinel rows are not written."""
    E, two_i, H = w_gate_up.shape
    S = routing.order.numel()
    out = torch.empty(S, H, dtype=out_dtype, device=dh.device)
    cfg = config or default_backward_config(S, E, H, two_i // 2, w_gate_up.dtype).dx
    use_tma = cfg.use_tma and _tma_ok(w_gate_up) and _tma_ok(dh)
    dh_desc = gu_desc = None
    if use_tma:
        dh_desc = TensorDescriptor.from_tensor(dh, [cfg.block_m, cfg.block_k])
        gu_desc = TensorDescriptor.from_tensor(w_gate_up.view(E * two_i, H), [cfg.block_k, cfg.block_n])
    num_m = _m_tiles_bound(S, E, cfg.block_m)
    _dx_kernel[(num_m * cdiv(H, cfg.block_n),)](
        dh,
        dh_desc,
        routing.order,
        routing.counts,
        w_gate_up,
        gu_desc,
        out,
        H,
        two_i // 2,
        E,
        num_m,
        *w_gate_up.stride(),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        E_P2=next_power_of_2(E),
        EVEN_K=two_i % cfg.block_k == 0,
        USE_TMA=use_tma,
        INTERPRET=interpreting(),
        DOT_PRECISION=_dot_precision(w_gate_up.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def experts_by_rows(routing: Routing) -> torch.Tensor:
    """[E] int32, experts by decreasing row count (ties by index): the wgrad grid's order.

    With uneven routing an expert's reduction can be many times the mean; starting those first
    keeps them off the tail of the grid (longest-processing-time-first scheduling).
    """
    return torch.sort(routing.counts, descending=True, stable=True).indices.to(torch.int32)


def wgrad(left, l_gather: bool, right, r_gather: bool, routing: Routing, num_experts: int, top_k: int, out_dtype,
          *, config: GemmConfig | None = None, experts_by_load: torch.Tensor | None = None):
    """[E, M, N] with out[e] = left[rows of e]^T @ right[rows of e]; a gathered operand is indexed by token.

    left [*, M] and right [*, N] are 2-D with any strides; every expert's block is written (zeros without rows).
    """
    M, N = left.shape[1], right.shape[1]
    E = num_experts
    S = routing.order.numel()
    out = torch.empty(E, M, N, dtype=out_dtype, device=left.device)
    cfg = config or _wgrad_config(S, E, out_dtype, "gate_up")
    num_m, num_n = cdiv(M, cfg.block_m), cdiv(N, cfg.block_n)
    if experts_by_load is None:
        experts_by_load = experts_by_rows(routing)
    _wgrad_kernel[(E * num_m * num_n,)](
        left,
        right,
        routing.order,
        routing.offsets,
        experts_by_load,
        out,
        M,
        N,
        num_m,
        num_n,
        left.stride(0),
        left.stride(1),
        right.stride(0),
        right.stride(1),
        TOP_K=top_k,
        L_GATHER=l_gather,
        R_GATHER=r_gather,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        INTERPRET=interpreting(),
        DOT_PRECISION=_dot_precision(out_dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def d_weights_by_row(part, routing: Routing, num_experts: int, out_dtype):
    """[S] by row: the partials summed in tile order; sentinel rows zero."""
    S = routing.order.numel()
    out = torch.empty(S, dtype=out_dtype, device=part.device)
    block = 1024
    _dweights_kernel[(cdiv(S, block),)](
        part, routing.order, routing.offsets, out, S, num_experts, part.shape[0], BLOCK=block, num_warps=4
    )
    return out


# --------------------------------------------------------------------------- entry point


def experts_backward(dy, x, ids, weights, w_gate_up, w_down, h=None, *, config: BackwardConfig | None = None,
                     routing: Routing | None = None, swiglu_limit: float | None = None, glu_alpha: float | None = None,
                     activation: str = "silu", overlap_wgrad: bool = True):
    """(dx, d_weights, d_w_gate_up, d_w_down): the semantics and dtypes of ``reference.experts_backward``.
    overlap_wgrad: dW_gate_up on a second CUDA stream, next to dx and dW_down.

    dy [T, H] (any strides, stride 0 included), x [T, H], ids [T, k] (ids >= E: expert-parallel
    sentinels, zero contribution and zero gradient), weights [T, k], w_gate_up [E, 2I, H],
    w_down [E, H, I]; h: the forward's saved pre-activation (``experts_forward(save_h=True)``),
    or None to recompute it; routing: the forward's (``route(ids, E)``), or None to route again.
    Outputs are contiguous, in the dtypes of x, weights, w_gate_up, w_down, except that the gradient of a weight
    given as the transpose of a contiguous tensor is the transpose of a contiguous one too.
    """
    if softcaps(activation) is not None:
        raise ValueError("experts_backward: the softcapped SwiGLU runs on grouped_mm_path only")
    T, H = x.shape
    k = ids.shape[1]
    E, two_i, _ = w_gate_up.shape
    I = two_i // 2
    S = T * k
    dev = x.device
    if S == 0:
        return (
            torch.zeros(T, H, dtype=x.dtype, device=dev),
            torch.zeros(T, k, dtype=weights.dtype, device=dev),
            torch.zeros(w_gate_up.shape, dtype=w_gate_up.dtype, device=dev),
            torch.zeros(w_down.shape, dtype=w_down.dtype, device=dev),
        )
    check_saved_h(h, S, w_gate_up)
    cfg = config or default_backward_config(S, E, H, I, w_gate_up.dtype, saved_h=h is not None)
    # The gradient of a sum arrives with stride 0 (and the kernels index dy as [T, H] rows).
    dy = dy.contiguous()
    ids = ids.contiguous()
    rw = weights.reshape(-1).contiguous()
    if routing is None:
        routing = route(ids, E)

    if h is None:
        dh, aw, part = dgrad(dy, x, routing, rw, w_gate_up, w_down, k, config=cfg.dgrad, swiglu_limit=swiglu_limit,
                             glu_alpha=glu_alpha, activation=activation)
        d_weights = d_weights_by_row(part, routing, E, weights.dtype)
    else:
        dh, aw, d_weights = dgrad_saved(
            dy, routing, rw, h, w_down, k, weights.dtype, config=cfg.dgrad, swiglu_limit=swiglu_limit, glu_alpha=glu_alpha,
            activation=activation,
        )
    by_load = experts_by_rows(routing)
    side = side_stream(dev) if overlap_wgrad and dev.type == "cuda" and not interpreting() else None
    main = torch.cuda.current_stream(dev) if side is not None else None
    if side is not None:
        # dW_gate_up needs only d_h, x and the routing, all ready (everything above is queued on this
        # stream before the wait): it runs on a second stream next to dx, combine and dW_down. Its inputs
        # were allocated on this stream, and this stream waits for it before returning, so none is freed
        # or reused while it still runs.
        side.wait_stream(main)
    with torch.cuda.stream(side):  # None: stay on the current stream
        if transposed(w_gate_up):  # written as the [E, H, 2I] the model stores (ops.weight_layout)
            d_wgu = wgrad(x, True, dh, False, routing, E, k, w_gate_up.dtype, config=cfg.wgrad,
                          experts_by_load=by_load).transpose(1, 2)
        else:
            d_wgu = wgrad(dh, False, x, True, routing, E, k, w_gate_up.dtype, config=cfg.wgrad, experts_by_load=by_load)
    if side is not None:
        d_wgu.record_stream(main)  # allocated on the side stream, used (and freed) on this one
    # Slots in the GEMM dtype (fp32 if x is fp32): half the traffic of fp32 slots; the sum over k is fp32.
    slots = dx_slots(dh, routing, w_gate_up, torch.promote_types(x.dtype, w_gate_up.dtype), config=cfg.dx)
    dx = combine(slots, ids, E, x.dtype)
    if transposed(w_down):
        d_wd = wgrad(aw, False, dy, True, routing, E, k, w_down.dtype, config=cfg.wgrad_down or cfg.wgrad,
                     experts_by_load=by_load).transpose(1, 2)
    else:
        d_wd = wgrad(dy, True, aw, False, routing, E, k, w_down.dtype, config=cfg.wgrad_down or cfg.wgrad,
                     experts_by_load=by_load)
    if side is not None:
        main.wait_stream(side)
    return dx, d_weights.view(T, k), d_wgu, d_wd


def check_saved_h(h, S: int, w_gate_up) -> None:
    two_i = w_gate_up.shape[1]
    if h is not None and (tuple(h.shape) != (S, two_i) or h.dtype != w_gate_up.dtype or not h.is_contiguous()):
        raise ValueError(
            f"experts_backward: saved h must be a contiguous [S={S}, 2I={two_i}] {w_gate_up.dtype} tensor, "
            f"got {tuple(h.shape)} {h.dtype}"
        )


# dW_gate_up on a second CUDA stream, concurrent with dx and dW_down (``overlap_wgrad``: ``config.overlap_wgrad``).
# grouped_mm_path.py runs on one stream (its CUTLASS GEMMs each fill the GPU).
_SIDE_STREAMS: dict = {}


def side_stream(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


__all__ = ["BackwardConfig", "default_backward_config", "experts_backward", "supports"]
