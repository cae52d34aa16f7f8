"""The weighted rows of each token summed over its k slots: y[t] = sum_j out[t, j] (fp32, j in order).

A fixed-order reduction instead of atomics in the down GEMM, so y is bitwise
repeatable. The buffer is [T, k, H] contiguous, written by ``grouped_gemm.down``
for every slot routed to a local expert; slots whose id is an expert-parallel
sentinel (id >= E) were never written and count as zero, as in the reference.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._jit import cdiv, interpreting, lazy_jit, next_power_of_2

BLOCK_T = 4
BLOCK_H = 512


@lazy_jit
def _combine_kernel(
    slots_ptr,  # [T, k, H]
    ids_ptr,  # [T, k] contiguous
    y_ptr,  # [T, H] out
    T,
    H,
    E,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < T
    mask = t_ok[:, None] & (h < H)[None, :]
    row = t.to(tl.int64) * TOP_K
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in range(TOP_K):
        local = tl.load(ids_ptr + row + j, mask=t_ok, other=E) < E
        acc += tl.load(
            slots_ptr + (row + j)[:, None] * H + h[None, :], mask=mask & local[:, None], other=0.0
        ).to(tl.float32)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * H + h[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def combine(slots: torch.Tensor, ids: torch.Tensor, num_experts: int, out_dtype: torch.dtype) -> torch.Tensor:
    """slots [T*k, H] (row = token * k + slot) -> y [T, H] in ``out_dtype``."""
    T, k = ids.shape
    H = slots.shape[-1]
    y = torch.empty(T, H, dtype=out_dtype, device=slots.device)
    if T == 0 or H == 0:
        return y
    block_h = min(BLOCK_H, next_power_of_2(H))
    block_t = 32 if interpreting() else BLOCK_T  # fewer, larger programs for the interpreter
    grid = (cdiv(T, block_t), cdiv(H, block_h))
    _combine_kernel[grid](
        slots, ids.contiguous(), y, T, H, num_experts, TOP_K=k, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4
    )
    return y
