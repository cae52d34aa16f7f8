"""The two grouped GEMMs of the experts block, over rows sorted by expert.

``gate_up``:  a[p] = silu(x[tok(p)] @ W_gate[e]^T) * (x[tok(p)] @ W_up[e]^T)      [S, I]
``down``:     out[row(p)] = weight[row(p)] * (a[p] @ W_down[e]^T)                 [S, H]

p is a sorted position (routing.Routing.order[p] = row = token * k + slot) and
e the expert that owns p. Both kernels launch one program per (M-tile, N-tile),
where every M-tile holds rows of a single expert. The grid is sized with the
upper bound ceil(S / BLOCK_M) + E M-tiles (each expert wastes at most one
partial tile), so no host sync is needed to read the per-expert counts; the
programs past the real tile count exit at once. Each program finds its expert
from ``counts`` itself (a prefix sum over E values, negligible next to the
tile's K loop), so each GEMM can use its own BLOCK_M.

With ``use_tma`` (Hopper), the weight tiles (and the contiguous A rows of the
down GEMM) come through host-built tensor descriptors (the bulk tensor copy
engine) instead of pointer loads; the gathered x rows of gate_up stay pointer
loads. A tile that runs past an expert's rows or columns reads its neighbour's
(or zeros past the tensor's end): those rows and columns are never stored.

Accumulation is fp32. The operands are the weights' dtype (x is cast to it, as
in the reference). Under the Triton interpreter, ``tl.dot`` on bf16 operands is
wrong in triton 3.6, so the operands are upcast to fp32 there (``INTERPRET``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from ..reference import limit_in
from ._jit import cdiv, interpreting, lazy_jit, next_power_of_2
from .jit_math import glu
from .jit_tiles import expert_tile_counts, grouped_tile, tile_rows
from .routing import Routing


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1  # M-tiles walked together over all N-tiles (L2 reuse of the A rows and weight tiles)
    num_warps: int = 4
    num_stages: int = 3
    use_tma: bool = False  # weights through tensor descriptors (needs contiguous weights, 16-byte rows)


# Small blocks keep the interpreter fast; the numbers are not a performance choice.
INTERPRETER_CONFIG = GemmConfig(16, 32, 32, 1, 4, 1)


@lazy_jit
def _gate_up_kernel(
    x_ptr,  # [T, H]
    order_ptr,  # [S] int32, sorted position -> row
    counts_ptr,  # [E] int32
    w_ptr,  # [E, 2I, H]
    w_desc,  # descriptor of w viewed as [E * 2I, H], blocks [BLOCK_N, BLOCK_K] (USE_TMA only)
    a_ptr,  # [S, I] out, sorted order, weights' dtype
    h_ptr,  # [S, 2I] out (only when SAVE_H): pre-activation gate | up
    H,
    I,
    E,
    num_m_tiles,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_wh,
    limit,  # swiglu_limit in h's dtype (LIMITED)
    alpha,  # glu_alpha (ALPHA_GATE)
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_P2: tl.constexpr,
    EVEN_K: tl.constexpr,
    SAVE_H: tl.constexpr,
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
    pos = row_begin + m  # sorted positions of this tile
    src = tl.load(order_ptr + pos, mask=row_valid, other=0)
    token = src // TOP_K  # rows past the expert's end read token 0: valid memory, never stored

    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_load = tl.minimum(n, I - 1)  # clamp instead of mask: the extra columns are never stored
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token.to(tl.int64)[:, None] * stride_xt + kk[None, :] * stride_xh
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    g_ptrs = w_e + n_load[None, :] * stride_wn + kk[:, None] * stride_wh  # [BLOCK_K, BLOCK_N] = W_gate^T tile
    up_offset = I * stride_wn
    gate_row = expert * (2 * I) + pid_n * BLOCK_N  # row of the [E * 2I, H] view (USE_TMA)

    w_dtype = w_ptr.dtype.element_ty
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=((k0 + kk) < H)[None, :], other=0.0)
        if USE_TMA:
            bg = w_desc.load([gate_row, k0]).T
            bu = w_desc.load([gate_row + I, k0]).T
        elif EVEN_K:
            bg = tl.load(g_ptrs)
            bu = tl.load(g_ptrs + up_offset)
        else:
            k_ok = (k0 + kk) < H
            bg = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            bu = tl.load(g_ptrs + up_offset, mask=k_ok[:, None], other=0.0)
        a = a.to(w_dtype)  # the reference casts x to the weights' dtype
        if INTERPRET:
            a = a.to(tl.float32)
            bg = bg.to(tl.float32)
            bu = bu.to(tl.float32)
        acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wh

    # ---- epilogue: SwiGLU in fp32, one rounding to the weights' dtype
    out_mask = row_valid[:, None] & (n < I)[None, :]
    pos64 = pos.to(tl.int64)[:, None]
    if SAVE_H:
        h_ptrs = h_ptr + pos64 * (2 * I) + n[None, :]
        tl.store(h_ptrs, acc_g.to(h_ptr.dtype.element_ty), mask=out_mask)
        tl.store(h_ptrs + I, acc_u.to(h_ptr.dtype.element_ty), mask=out_mask)
    if LIMITED:  # the clamp applies to what h stores (rounded), as eager clamps h
        acc_g = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)
        acc_u = acc_u.to(h_ptr.dtype.element_ty).to(tl.float32)
    act = glu(acc_g, acc_u, limit, alpha, 1.0, 1.0, LIMITED, ALPHA_GATE, GELU_TANH, False)
    tl.store(a_ptr + pos64 * I + n[None, :], act.to(a_ptr.dtype.element_ty), mask=out_mask)


@lazy_jit
def _down_kernel(
    a_ptr,  # [S, I] sorted order
    a_desc,  # descriptor of a, blocks [BLOCK_M, BLOCK_K] (USE_TMA only)
    order_ptr,  # [S] int32
    counts_ptr,  # [E] int32
    w_ptr,  # [E, H, I]
    w_desc,  # descriptor of w viewed as [E * H, I], blocks [BLOCK_N, BLOCK_K] (USE_TMA only)
    rw_ptr,  # [S] routing weights, by row
    out_ptr,  # [S, H] out, by row (= [T, k, H])
    H,
    I,
    E,
    num_m_tiles,
    stride_we,
    stride_wn,
    stride_wk,
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

    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_load = tl.minimum(n, H - 1)
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + pos.to(tl.int64)[:, None] * I + kk[None, :]
    b_ptrs = w_ptr + expert.to(tl.int64) * stride_we + n_load[None, :] * stride_wn + kk[:, None] * stride_wk

    a_row = row_begin + tile_in_expert * BLOCK_M  # USE_TMA: first row of the tile in a
    w_row = expert * H + pid_n * BLOCK_N  # USE_TMA: row of the [E * H, I] view

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if USE_TMA:
            # Past I (K tail) and past S the descriptors read zeros.
            a = a_desc.load([a_row, k0])
            b = w_desc.load([w_row, k0]).T
        elif EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = (k0 + kk) < I
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if INTERPRET:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk

    # ---- epilogue: routing weight, then the row goes back to its (token, slot) place
    rw = tl.load(rw_ptr + src, mask=row_valid, other=0.0).to(tl.float32)
    out = acc * rw[:, None]
    out_mask = row_valid[:, None] & (n < H)[None, :]
    tl.store(out_ptr + src.to(tl.int64)[:, None] * H + n[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)


# --------------------------------------------------------------------------- configs


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 weights: follow torch's matmul setting, so the kernel rounds like the reference would.
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def default_config(kind: str, S: int, E: int, N: int, K: int, dtype: torch.dtype) -> GemmConfig:
    """Block shapes for one GEMM ("gate_up": N = I, K = H; "down": N = H, K = I) from the average rows per expert.

    Measured on an H200 with bench/kernels.py (docs/kernels.md, docs/performance.md).
    Depends only on a bucket of S / E, never on the exact token count, so a new
    batch size does not compile new kernels.
    """
    if interpreting():
        return INTERPRETER_CONFIG
    rows = S / max(E, 1)
    wide = dtype != torch.float32  # fp32 operands take twice the shared memory per stage
    bk = 64 if wide else 32
    if rows <= 16:
        # Decode-like: a few rows per expert and streaming the weights is the cost: narrow N-tiles
        # for more programs in flight (gate_up has two B tiles per program).
        return GemmConfig(16, 32 if kind == "gate_up" else 64, 2 * bk, 1, 4, 4)
    if rows <= 48:
        return GemmConfig(32, 64, 2 * bk, 1, 4, 4)
    if rows <= 160:
        return GemmConfig(64, 128, bk, 1, 4, 4)
    # Large batches. H200, T=16384, bf16 (30B / 235B layers): TMA weight tiles beat pointer loads by
    # 6-10% on both GEMMs; gate_up's two 128x128 accumulators (a 128x256 tile) at 3 stages, down
    # 128x256 with 4 stages when its K loop (I) is long, 3 when short.
    if kind == "gate_up":
        return GemmConfig(128, 128, bk, 8, 8, 3, use_tma=wide)
    return GemmConfig(128, 256, bk, 8, 8, 4 if K >= 1024 else 3, use_tma=wide)


def _tma_ok(t: torch.Tensor) -> bool:
    # A descriptor needs a contiguous tensor, a 16-byte aligned base and 16-byte aligned rows.
    return t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0


def _m_tiles_bound(S: int, E: int, block_m: int) -> int:
    # sum_e ceil(c_e / BM) <= S / BM + (number of non-empty experts); and a tile holds at least one row.
    return min(cdiv(S, block_m) + E, S)


# --------------------------------------------------------------------------- launchers


def gate_up(
    x: torch.Tensor,
    routing: Routing,
    w_gate_up: torch.Tensor,
    top_k: int,
    *,
    save_h: bool = False,
    swiglu_limit: float | None = None,
    glu_alpha: float | None = None,
    activation: str = "silu",
    config: GemmConfig | None = None,
):
    """a [S, I] (sorted order, weights' dtype) and, if ``save_h``, h [S, 2I] = the pre-activation gate | up.

    swiglu_limit: gate and up clamped first (``reference.clamp_gate_up``); glu_alpha, activation:
    ``reference.glu``'s gate."""
    E, two_i, H = w_gate_up.shape
    I = two_i // 2
    S = routing.order.numel()
    a = torch.empty(S, I, dtype=w_gate_up.dtype, device=x.device)
    h = torch.empty(S, two_i, dtype=w_gate_up.dtype, device=x.device) if save_h else None
    if S == 0:
        return a, h
    cfg = config or default_config("gate_up", S, E, I, H, w_gate_up.dtype)
    limit = limit_in(w_gate_up.dtype, swiglu_limit)
    use_tma = cfg.use_tma and _tma_ok(w_gate_up)
    w_desc = TensorDescriptor.from_tensor(w_gate_up.view(E * two_i, H), [cfg.block_n, cfg.block_k]) if use_tma else None
    num_m = _m_tiles_bound(S, E, cfg.block_m)
    grid = (num_m * cdiv(I, cfg.block_n),)
    _gate_up_kernel[grid](
        x,
        routing.order,
        routing.counts,
        w_gate_up,
        w_desc,
        a,
        h if save_h else a,
        H,
        I,
        E,
        num_m,
        x.stride(0),
        x.stride(1),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        w_gate_up.stride(2),
        0.0 if limit is None else limit,
        1.0 if glu_alpha is None else float(glu_alpha),
        TOP_K=top_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        E_P2=next_power_of_2(E),
        EVEN_K=H % cfg.block_k == 0,
        SAVE_H=save_h,
        LIMITED=limit is not None,
        ALPHA_GATE=glu_alpha is not None,
        GELU_TANH=activation == "gelu_tanh",
        USE_TMA=use_tma,
        INTERPRET=interpreting(),
        DOT_PRECISION=_dot_precision(w_gate_up.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return a, h


def down(
    a: torch.Tensor,
    routing: Routing,
    weights: torch.Tensor,
    w_down: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """[S, H] by row (token * k + slot): weights[row] * (a[p] @ W_down[e]^T), in ``out_dtype``."""
    E, H, I = w_down.shape
    S = routing.order.numel()
    out = torch.empty(S, H, dtype=out_dtype, device=a.device)
    if S == 0:
        return out
    a = a.contiguous()
    rw = weights.reshape(-1).contiguous()
    cfg = config or default_config("down", S, E, H, I, w_down.dtype)
    use_tma = cfg.use_tma and _tma_ok(w_down) and _tma_ok(a)
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k]) if use_tma else None
    w_desc = TensorDescriptor.from_tensor(w_down.view(E * H, I), [cfg.block_n, cfg.block_k]) if use_tma else None
    num_m = _m_tiles_bound(S, E, cfg.block_m)
    grid = (num_m * cdiv(H, cfg.block_n),)
    _down_kernel[grid](
        a,
        a_desc,
        routing.order,
        routing.counts,
        w_down,
        w_desc,
        rw,
        out,
        H,
        I,
        E,
        num_m,
        w_down.stride(0),
        w_down.stride(1),
        w_down.stride(2),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        E_P2=next_power_of_2(E),
        EVEN_K=I % cfg.block_k == 0,
        USE_TMA=use_tma,
        INTERPRET=interpreting(),
        DOT_PRECISION=_dot_precision(w_down.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
