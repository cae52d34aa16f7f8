"""Rows in expert order back to tokens: the expert-parallel path (moe_fuse/parallel), where the routed
rows travel between ranks sorted by expert, and the grouped_mm path (grouped_mm_path.py).

Row p of ``rows`` [S, H] is slot ``order[p]`` (= token * k + j), and ``pos`` is the inverse
permutation (pos[order[p]] = p).

    combine_sorted(rows, pos, weights)  y[t] = sum_j weights[t, j] * rows[pos[t*k + j]]   (weights None: 1)
        with ids / num_experts: slots whose id >= num_experts (sentinels) count as zero
    expand_rows(x, pos)                 out[pos[t*k + j]] = x[t]   (the rows of each expert's GEMM, x read once)
    combine_sorted_backward(dy, rows, order, weights, k)
        d_rows[p]        = weights[slot] * dy[slot // k]        slot = order[p]
        d_weights[slot]  = sum_h dy[slot // k, h] * rows[p, h]

One read of every row, a fixed-order fp32 sum over the k slots (bitwise repeatable), and no [T, k, H]
temporary: torch spells the same as index_select + a broadcast multiply + sum, whose backward is an
index_add and fp32 elementwise passes over [T, k, H] (on the H200, ~7 of the ~22 ms of a 2-GPU EP
layer step, bench/ep_layer.py).

Products are rounded to promote(rows, weights) before the fp32 sum, as the torch spelling rounds them.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._jit import cdiv, interpreter_usable, lazy_jit

BLOCK_T = 16
BLOCK_H = 256


@lazy_jit
def _combine_sorted_kernel(
    rows_ptr,  # [S, H] contiguous, expert order
    pos_ptr,  # [T * k] int32 or int64: sorted position of each slot
    w_ptr,  # [T * k] routing weights (WEIGHTED)
    ids_ptr,  # [T * k] expert ids (SENTINELS)
    y_ptr,  # [T, H] out
    T,
    H,
    E,
    TOP_K: tl.constexpr,
    WEIGHTED: tl.constexpr,
    SENTINELS: tl.constexpr,  # slots with ids >= E are skipped (their rows were never written)
    PROD_DTYPE: tl.constexpr,  # the dtype the torch spelling rounds each product to
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < T
    mask = t_ok[:, None] & (h < H)[None, :]
    slot = t.to(tl.int64) * TOP_K
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        p = tl.load(pos_ptr + slot + j, mask=t_ok, other=0).to(tl.int64)
        live = mask
        if SENTINELS:
            live = live & (tl.load(ids_ptr + slot + j, mask=t_ok, other=E) < E)[:, None]
        r = tl.load(rows_ptr + p[:, None] * H + h[None, :], mask=live, other=0.0).to(tl.float32)
        if WEIGHTED:
            w = tl.load(w_ptr + slot + j, mask=t_ok, other=0.0).to(tl.float32)
            r = (r * w[:, None]).to(PROD_DTYPE).to(tl.float32)
        acc += r
    tl.store(y_ptr + t.to(tl.int64)[:, None] * H + h[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@lazy_jit
def _combine_sorted_backward_kernel(
    dy_ptr,  # [T, H] contiguous
    rows_ptr,  # [S, H] contiguous (WEIGHTED: read for d_weights)
    order_ptr,  # [S] int64: slot of each sorted position
    w_ptr,  # [T * k] (WEIGHTED)
    d_rows_ptr,  # [S, H] out
    d_w_ptr,  # [T * k] out (WEIGHTED)
    S,
    H,
    TOP_K: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = p < S
    slot = tl.load(order_ptr + p, mask=p_ok, other=0)
    tok = slot // TOP_K
    if WEIGHTED:
        w = tl.load(w_ptr + slot, mask=p_ok, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = p_ok[:, None] & (h < H)[None, :]
        g = tl.load(dy_ptr + tok[:, None] * H + h[None, :], mask=mask, other=0.0).to(tl.float32)
        out = d_rows_ptr + p.to(tl.int64)[:, None] * H + h[None, :]
        if WEIGHTED:
            r = tl.load(rows_ptr + p.to(tl.int64)[:, None] * H + h[None, :], mask=mask, other=0.0).to(tl.float32)
            dot += tl.sum(g * r, axis=1)
            g = g * w[:, None]
        tl.store(out, g.to(d_rows_ptr.dtype.element_ty), mask=mask)
    if WEIGHTED:
        tl.store(d_w_ptr + slot, dot.to(d_w_ptr.dtype.element_ty), mask=p_ok)


@lazy_jit
def _expand_rows_kernel(
    x_ptr,  # [T, H] contiguous
    pos_ptr,  # [T * k] int32 or int64: sorted position of each slot
    out_ptr,  # [T * k, H] out
    T,
    H,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < T
    mask = t_ok[:, None] & (h < H)[None, :]
    slot = t.to(tl.int64) * TOP_K
    row = tl.load(x_ptr + t.to(tl.int64)[:, None] * H + h[None, :], mask=mask)
    for j in tl.static_range(TOP_K):
        p = tl.load(pos_ptr + slot + j, mask=t_ok, other=0).to(tl.int64)
        tl.store(out_ptr + p[:, None] * H + h[None, :], row, mask=mask)


def expand_rows(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """out [T*k, H] with out[pos[t, j]] = x[t]; pos [T, k] (int32 or int64), a permutation of the slots.

    The same rows as ``x.index_select(0, token)`` (token = the token of each sorted position), written
    from the token side: each row of x is read once and stored k times, where the gather reads it k
    times (x, [T, H], is larger than the L2 cache at training sizes): ~(1 + k) instead of 2k row
    transfers.
    """
    T, k = pos.shape
    H = x.shape[1]
    x = x.contiguous()
    out = torch.empty(T * k, H, dtype=x.dtype, device=x.device)
    if not _use_kernels(x):
        out[pos.reshape(-1).long()] = x.repeat_interleave(k, dim=0)
        return out
    if T == 0 or H == 0:
        return out
    _expand_rows_kernel[(cdiv(T, BLOCK_T), cdiv(H, BLOCK_H))](
        x, pos.contiguous(), out, T, H, TOP_K=k, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, num_warps=4
    )
    return out


def _use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda or (t.device.type == "cpu" and interpreter_usable())


def _prod_dtype(rows, weights):
    return rows.dtype if weights is None else torch.promote_types(rows.dtype, weights.dtype)


def combine_sorted(rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None, out_dtype, *,
                   ids: torch.Tensor | None = None, num_experts: int = 0) -> torch.Tensor:
    """y [T, H] = sum_j weights[t, j] * rows[pos[t*k + j]]; pos [T, k] (int32 or int64), weights [T, k] or None.

    ids [T, k]: slots with ids >= num_experts are left out (their rows may hold anything).
    """
    T, k = pos.shape
    H = rows.shape[1]
    rows = rows.contiguous()
    if not _use_kernels(rows):
        picked = rows.index_select(0, pos.reshape(-1).long()).view(T, k, H)
        if ids is not None:
            picked = torch.where((ids < num_experts).unsqueeze(-1), picked, picked.new_zeros(()))
        if weights is not None:
            picked = picked * weights.unsqueeze(-1)
        return picked.float().sum(dim=1).to(out_dtype)
    y = torch.empty(T, H, dtype=out_dtype, device=rows.device)
    if T == 0 or H == 0:
        return y
    prod = getattr(tl, str(_prod_dtype(rows, weights)).removeprefix("torch."))
    w = weights.contiguous() if weights is not None else pos  # not read unless WEIGHTED
    live = ids.contiguous() if ids is not None else pos  # not read unless SENTINELS
    _combine_sorted_kernel[(cdiv(T, BLOCK_T), cdiv(H, BLOCK_H))](
        rows, pos.contiguous(), w, live, y, T, H, num_experts, TOP_K=k, WEIGHTED=weights is not None,
        SENTINELS=ids is not None, PROD_DTYPE=prod, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, num_warps=4,
    )
    return y


def combine_sorted_backward(dy: torch.Tensor, rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor | None,
                            top_k: int):
    """(d_rows [S, H] in rows' dtype, d_weights [T, k] in weights' dtype or None) of ``combine_sorted``;
    order [S] int64 = the slot of each sorted position. Without weights, d_rows[p] = dy[order[p] // k]:
    also the gather of token rows into expert order."""
    S, H = rows.shape
    k = top_k
    dy = dy.contiguous()
    if not _use_kernels(rows):
        tok = order // k
        g = dy.index_select(0, tok).float()
        if weights is None:
            return g.to(rows.dtype), None
        w = weights.reshape(-1).index_select(0, order).float()
        d_w = torch.empty(weights.numel(), dtype=torch.float32, device=rows.device)
        d_w[order] = (g * rows.float()).sum(dim=1)
        return (g * w[:, None]).to(rows.dtype), d_w.view_as(weights).to(weights.dtype)
    d_rows = torch.empty(S, H, dtype=rows.dtype, device=rows.device)
    d_w = torch.empty(weights.shape, dtype=weights.dtype, device=rows.device) if weights is not None else None
    if S == 0:
        return d_rows, d_w
    block_p = 16
    _combine_sorted_backward_kernel[(cdiv(S, block_p),)](
        dy, rows.contiguous(), order.contiguous(), weights.contiguous() if weights is not None else order, d_rows,
        d_w if d_w is not None else d_rows, S, H, TOP_K=k, WEIGHTED=weights is not None, BLOCK_P=block_p,
        BLOCK_H=128 if H >= 128 else 32, num_warps=4,
    )
    return d_rows, d_w


__all__ = ["combine_sorted", "combine_sorted_backward", "expand_rows"]
