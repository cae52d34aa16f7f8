"""The activation passes of experts without a gate (transformers' ``has_gate=False``: Nemotron-H).

Such experts have an up projection only: h = xs @ W_up[e]^T is [S, I], and the activation is
``reference.ungated_act`` (relu(up)^2). grouped_mm_path runs these two passes where gated experts run
SwiGLU and dSwiGLU; the GEMMs around them are the same functions, on [E, I, H] instead of [E, 2I, H]:

    forward   aw = w * act(h)                         [S, I]  (w: the row's routing weight)
    backward  d_h = w * g * act'(h)                   [S, I]  (g = dy[tok] @ W_down[e])
              d_weights = sum_i g * act(h)            by row, one fixed-order sum per row

Both in fp32, rounded once, rows in expert order; rows past offsets[E] (expert-parallel sentinels) are
not written (d_weights 0 there), as in the gated passes.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ..reference import UNGATED
from ._jit import cdiv, interpreting, lazy_jit
from .jit_math import relu


@lazy_jit
def _act_kernel(
    h_ptr,  # [S, I] sorted order: up
    rw_ptr,  # [T * k] routing weights, by row (slot)
    order_ptr,  # [S] int32: sorted position -> row
    a_ptr,  # [S, I] out
    offsets_ptr,  # [E + 1] int32; offsets[E] = routed rows
    S,
    I,
    E,
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    p = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    routed = (p < S) & (p < tl.load(offsets_ptr + E))
    src = tl.load(order_ptr + p, mask=routed, other=0)
    w = tl.load(rw_ptr + src, mask=routed, other=0.0).to(tl.float32)[:, None]
    p64 = p.to(tl.int64)[:, None]
    for i0 in range(0, I, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        mask = routed[:, None] & (i < I)[None, :]
        up = tl.load(h_ptr + p64 * I + i[None, :], mask=mask, other=0.0).to(tl.float32)
        r = relu(up)
        # the product order is _dact_kernel's, so both round to the same aw
        tl.store(a_ptr + p64 * I + i[None, :], (w * (r * r)).to(a_ptr.dtype.element_ty), mask=mask)


@lazy_jit
def _dact_kernel(
    g_ptr,  # [S, I] sorted order
    h_ptr,  # [S, I] sorted order: the forward's up
    rw_ptr,  # [T * k] routing weights, by row
    order_ptr,  # [S] int32
    offsets_ptr,  # [E + 1] int32; offsets[E] = routed rows
    dh_ptr,  # [S, I] out, sorted order
    aw_ptr,  # [S, I] out, sorted order (WRITE_AW)
    dw_ptr,  # [T * k] out, by row
    S,
    I,
    E,
    WRITE_AW: tl.constexpr,  # False: the forward kept aw, skip the [S, I] store
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    # Whole rows per program: the d_weights row sum is one fixed-order reduction (no partials).
    p = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_s = p < S
    routed = p < tl.load(offsets_ptr + E)
    src = tl.load(order_ptr + p, mask=in_s, other=0)
    w = tl.load(rw_ptr + src, mask=routed, other=0.0).to(tl.float32)[:, None]
    p64 = p.to(tl.int64)[:, None]
    dw = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for i0 in range(0, I, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        mask = routed[:, None] & (i < I)[None, :]
        g = tl.load(g_ptr + p64 * I + i[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + p64 * I + i[None, :], mask=mask, other=0.0).to(tl.float32)
        r = relu(up)
        a = r * r
        dw += tl.sum(g * a, axis=1)
        tl.store(dh_ptr + p64 * I + i[None, :], (w * g * (2.0 * r)).to(dh_ptr.dtype.element_ty), mask=mask)
        if WRITE_AW:
            tl.store(aw_ptr + p64 * I + i[None, :], (w * a).to(aw_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + src, dw.to(dw_ptr.dtype.element_ty), mask=in_s)


def _check(h: torch.Tensor, activation: str):
    if activation not in UNGATED:
        raise ValueError(f"ungated passes: activation must be one of {UNGATED}, got {activation!r}")
    if h.dim() != 2 or not h.is_contiguous():
        raise ValueError(f"ungated passes: h must be a contiguous [S, I] tensor, got {tuple(h.shape)}")


def _blocks():
    # SwiGLU's launch tile (grouped_mm_path.swiglu); small blocks keep the interpreter fast
    return (4, 32) if interpreting() else (4, 256)


def act(h: torch.Tensor, routing, rw: torch.Tensor, activation: str = "relu2") -> torch.Tensor:
    """aw [S, I] = w * act(h) in h's dtype, sorted order; rw [T * k] the routing weights by row."""
    _check(h, activation)
    S, I = h.shape
    a = torch.empty(S, I, dtype=h.dtype, device=h.device)
    block_r, block_i = _blocks()
    _act_kernel[(cdiv(S, block_r),)](
        h, rw, routing.order, a, routing.offsets, S, I, routing.counts.numel(),
        BLOCK_R=block_r, BLOCK_I=block_i, num_warps=4,
    )
    return a


def dact(g: torch.Tensor, h: torch.Tensor, rw: torch.Tensor, routing, weights_dtype, *, write_aw: bool = True,
         activation: str = "relu2"):
    """(d_h [S, I], aw [S, I] or None, d_weights [S] by row) from g = dy[tok] @ W_down[e] and the saved h, sorted
    order; write_aw False: aw is not computed (the caller kept the forward's)."""
    _check(h, activation)
    if g.shape != h.shape:
        raise ValueError(f"ungated passes: g {tuple(g.shape)} and h {tuple(h.shape)} must both be [S, I]")
    S, I = g.shape
    dh = torch.empty(S, I, dtype=g.dtype, device=g.device)
    aw = torch.empty(S, I, dtype=g.dtype, device=g.device) if write_aw else None
    d_weights = torch.empty(S, dtype=weights_dtype, device=g.device)
    block_r, block_i = _blocks()
    _dact_kernel[(cdiv(S, block_r),)](
        g, h, rw, routing.order, routing.offsets, dh, aw if write_aw else dh, d_weights, S, I,
        routing.counts.numel(), WRITE_AW=write_aw, BLOCK_R=block_r, BLOCK_I=block_i, num_warps=4,
    )
    return dh, aw, d_weights


__all__ = ["act", "dact"]
