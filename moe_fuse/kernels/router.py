"""Softmax top-k routing in one pass over the router logits.

    probs = softmax(logits, fp32); values, ids = topk(probs, k); [values /= values.sum()]; cast

torch runs this as four to six kernels, and its top-k alone takes ~0.12 ms for
16k tokens x 128 experts on an H200. Here one program holds BLOCK_T rows of
logits in registers and picks the k largest by repeated max: one read of the
logits, one write of the k weights and ids.

NaN and inf come out as torch's softmax and top-k give them. A row's
probabilities are all NaN (a NaN logit, a +inf one, or no finite one: all
-inf; then the softmax's sum is NaN) or all numbers with the largest > 0, and
torch.topk ranks NaN above every number: such a row gets NaN weights
(renormalised too) and ids in [0, E), its first k experts. The kernel tells a
NaN row by its first max (NaN, or the padding's -1 where the max skips NaN) and
writes that after the selection, a [BLOCK_T, BLOCK_K] select; the selection
itself compares NaN false and would match no column (the id BLOCK_E, which the
experts kernels would take for an expert-parallel sentinel and skip). The
backward recomputes the softmax: NaN rows give NaN gradients, as autograd does.

Ties (equal probabilities, NaN rows included) go to the lowest expert index,
for the experts picked and their order. torch.topk promises neither; measured
(tests/gpu/test_router_gpu.py checks the experts picked on CUDA):

- CUDA (torch 2.11, H100): the same experts (among ties at the k-th value the
  lowest indices), in another order within a tie: its sort of the k picked
  values is a bitonic network, not stable, e.g. [1, 0] for k = 2 and
  [7, 6, 4, 5, 1, 0, 2, 3] for k = 8 on an all-equal row (a zero router weight,
  transformers' initialisation, gives such rows);
- CPU: other experts too, e.g. [6, 5] for k = 2 of 8 equal values.

Equal values mean equal weights, so a tie's order only permutes equal-weight
slots: the experts op sums each token's slots in fp32, and a permutation
changes that sum by its rounding alone (tests/ops/test_non_finite_routing.py).

The backward to the logits (``softmax_topk_backward``) is one kernel too: it
recomputes the softmax from the logits, back-propagates the renormalisation
and the softmax, and adds the gradient that reached the logits directly. torch
runs that as a dozen small kernels, which at small batches cost more host time
than GPU time.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._jit import cdiv, lazy_jit, next_power_of_2
from .jit_math import masked_softmax


@lazy_jit
def _softmax_topk_kernel(
    logits_ptr,  # [T, E], row stride stride_t
    weights_ptr,  # [T, K] out
    ids_ptr,  # [T, K] out, int64
    T,
    E,
    stride_t,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    kk = tl.arange(0, BLOCK_K)
    t_ok = t < T
    valid = t_ok[:, None] & (e < E)[None, :]
    logits = tl.load(
        logits_ptr + t.to(tl.int64)[:, None] * stride_t + e[None, :], mask=valid, other=-float("inf")
    ).to(tl.float32)
    p = masked_softmax(logits, valid)
    p = tl.where(valid, p, -1.0)  # padding columns are never picked

    values = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)
        if j == 0:
            # A row's probabilities are all NaN or all numbers, the largest > 0: a NaN row's max is NaN or a
            # padding column's -1 (the GPU's max skips NaN, the interpreter's does not).
            nan_row = (best != best) | (best < 0.0)
        # lowest index among equal maxima
        arg = tl.min(tl.where(p == best[:, None], e[None, :], BLOCK_E), axis=1)
        values = tl.where(kk[None, :] == j, best[:, None], values)
        ids = tl.where(kk[None, :] == j, arg.to(tl.int64)[:, None], ids)
        p = tl.where(e[None, :] == arg[:, None], -1.0, p)
    # NaN rows: torch.topk ranks NaN above every number, ties lowest index first: experts 0..k-1, weights NaN.
    ids = tl.where(nan_row[:, None], kk[None, :].to(tl.int64), ids)
    values = tl.where(nan_row[:, None], float("nan"), values)
    if RENORM:
        values = values / tl.sum(values, axis=1)[:, None]  # unpicked columns hold 0
    out = t.to(tl.int64)[:, None] * TOP_K + kk[None, :]
    mask = t_ok[:, None] & (kk < TOP_K)[None, :]
    tl.store(weights_ptr + out, values.to(weights_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


def softmax_topk(logits: torch.Tensor, top_k: int, renorm: bool, weights_dtype: torch.dtype):
    """logits [T, E] -> (weights [T, k] in ``weights_dtype``, ids [T, k] int64), as torch's
    softmax(fp32) -> topk -> optional renorm -> cast."""
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top-k {top_k} with {E} experts")
    weights = torch.empty(T, top_k, dtype=weights_dtype, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_e = next_power_of_2(E)
    block_t = max(1, min(64, 4096 // block_e))  # ~4k logits per program in registers
    _softmax_topk_kernel[(cdiv(T, block_t),)](
        logits, weights, ids, T, E, logits.stride(0),
        TOP_K=top_k, RENORM=renorm, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=next_power_of_2(top_k), num_warps=4,
    )
    return weights, ids


@lazy_jit
def _softmax_topk_backward_kernel(
    logits_ptr,  # [T, E], row stride stride_t
    ids_ptr,  # [T, K] int64
    d_weights_ptr,  # [T, K] gradient of the routing weights
    d_logits_in_ptr,  # [T, E] contiguous gradient that reached the logits directly (HAS_D_LOGITS)
    out_ptr,  # [T, E] contiguous out, logits' dtype
    T,
    E,
    stride_t,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_D_LOGITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    t_ok = t < T
    valid = t_ok[:, None] & (e < E)[None, :]
    t64 = t.to(tl.int64)
    logits = tl.load(logits_ptr + t64[:, None] * stride_t + e[None, :], mask=valid, other=-float("inf")).to(tl.float32)
    p = masked_softmax(logits, valid)  # recomputed as the forward did

    # The picked probabilities, their sum and (for the renorm) sum_j dv_j * v_j / total.
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    dv_dot_v = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        idx = tl.load(ids_ptr + t64 * TOP_K + j, mask=t_ok, other=0)
        dv = tl.load(d_weights_ptr + t64 * TOP_K + j, mask=t_ok, other=0.0).to(tl.float32)
        v = tl.sum(tl.where(e[None, :] == idx[:, None], p, 0.0), axis=1)
        total += v
        dv_dot_v += dv * v
    # d_probs has d_values_j at the picked columns; sum_e d_probs * p = sum_j d_values_j * v_j.
    d_probs = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    dp_dot_p = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        idx = tl.load(ids_ptr + t64 * TOP_K + j, mask=t_ok, other=0)
        dv = tl.load(d_weights_ptr + t64 * TOP_K + j, mask=t_ok, other=0.0).to(tl.float32)
        if RENORM:
            # w = v / total  =>  dv_j -> (dv_j - sum_i dv_i w_i) / total
            dv = (dv - dv_dot_v / total) / total
        v = tl.sum(tl.where(e[None, :] == idx[:, None], p, 0.0), axis=1)
        d_probs = tl.where(e[None, :] == idx[:, None], dv[:, None], d_probs)
        dp_dot_p += dv * v
    d_scores = p * (d_probs - dp_dot_p[:, None])
    if HAS_D_LOGITS:
        d_scores += tl.load(d_logits_in_ptr + t64[:, None] * E + e[None, :], mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + t64[:, None] * E + e[None, :], d_scores.to(out_ptr.dtype.element_ty), mask=valid)


def softmax_topk_backward(d_logits, d_weights: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, renorm: bool):
    """Gradient w.r.t. the logits [T, E] (logits' dtype) of ``softmax_topk`` with the router's logits
    output: ``d_weights`` [T, k] reaches it through the (renormalised) softmax, ``d_logits`` [T, E]
    (or None) directly. Same math as ``reference.router_backward`` before its two matmuls."""
    T, E = logits.shape
    k = ids.shape[1]
    out = torch.empty(T, E, dtype=logits.dtype, device=logits.device)
    if T == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_e = next_power_of_2(E)
    block_t = max(1, min(64, 4096 // block_e))
    d_in = d_logits.contiguous() if d_logits is not None else out  # not read without HAS_D_LOGITS
    _softmax_topk_backward_kernel[(cdiv(T, block_t),)](
        logits, ids.contiguous(), d_weights.contiguous(), d_in, out, T, E, logits.stride(0),
        TOP_K=k, RENORM=renorm, HAS_D_LOGITS=d_logits is not None, BLOCK_T=block_t, BLOCK_E=block_e,
        num_warps=4,
    )
    return out
