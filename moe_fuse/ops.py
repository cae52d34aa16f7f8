"""The fused MoE custom ops: ``torch.ops.moe_fuse.router`` and ``torch.ops.moe_fuse.experts``.

Each op has a fake implementation (for tracing) and a registered autograd
formula whose backward is itself one opaque op, so AOTAutograd sees exactly
one fused node forward and one backward per MoE block.

Boundaries (the Triton kernels fill these in):
- router:  x, W_router -> logits, routing weights, expert ids
           (linear, softmax in fp32, top-k, optional renorm, cast).
- experts: x, ids, routing weights, W_gate_up, W_down -> y
           (routing metadata, permutation, gate_up GEMM, SwiGLU, down GEMM,
           weighted fixed-order combine over the k slots).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import kernels, reference

# --------------------------------------------------------------------------- router


@torch.library.custom_op("moe_fuse::router", mutates_args=())
def router(
    x: Tensor, weight: Tensor, top_k: int, renorm: bool, weights_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    if x.is_cuda:
        # cuBLAS for the logits (bitwise eager's), one Triton kernel for softmax + top-k + renorm + cast.
        logits = torch.nn.functional.linear(x, weight)
        return (logits, *kernels.softmax_topk(logits, top_k, renorm, weights_dtype))
    return reference.router_forward(x.contiguous(), weight, top_k, renorm, weights_dtype)


@router.register_fake
def _(x, weight, top_k, renorm, weights_dtype):
    T = x.shape[0]
    E = weight.shape[0]
    return (
        x.new_empty((T, E)),
        x.new_empty((T, top_k), dtype=weights_dtype),
        x.new_empty((T, top_k), dtype=torch.int64),
    )


@torch.library.custom_op("moe_fuse::router_backward", mutates_args=())
def router_backward(
    d_logits: Tensor, d_weights: Tensor, x: Tensor, weight: Tensor, logits: Tensor, ids: Tensor, renorm: bool
) -> tuple[Tensor, Tensor]:
    dx, dw = reference.router_backward(
        d_logits.contiguous(), d_weights.contiguous(), x.contiguous(), weight, logits, ids, renorm
    )
    return dx.contiguous(), dw.contiguous()


@router_backward.register_fake
def _(d_logits, d_weights, x, weight, logits, ids, renorm):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(
        weight, memory_format=torch.contiguous_format
    )


def _router_setup_context(ctx, inputs, output):
    x, weight, top_k, renorm, weights_dtype = inputs
    logits, _, ids = output
    ctx.save_for_backward(x, weight, logits, ids)
    ctx.renorm = renorm


def _router_backward(ctx, d_logits, d_weights, d_ids):
    x, weight, logits, ids = ctx.saved_tensors
    if d_logits is None:
        d_logits = torch.zeros_like(logits)
    if d_weights is None:
        d_weights = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    dx, dw = torch.ops.moe_fuse.router_backward(d_logits, d_weights, x, weight, logits, ids, ctx.renorm)
    return dx, dw, None, None, None


router.register_autograd(_router_backward, setup_context=_router_setup_context)

# --------------------------------------------------------------------------- experts


def _check_experts_args(x, ids, weights, w_gate_up, w_down):
    # Kernels index with these shapes; a mismatch must be an error, not a wrong answer.
    T, H = x.shape
    E, two_i, h2 = w_gate_up.shape
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != T:
        raise ValueError(f"moe_fuse.experts: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be [T={T}, k]")
    if h2 != H or two_i % 2 or tuple(w_down.shape) != (E, H, two_i // 2):
        raise ValueError(
            f"moe_fuse.experts: weights must be gate_up [E, 2I, H] and down [E, H, I]; got "
            f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)} for hidden size {H}"
        )


@torch.library.custom_op("moe_fuse::experts", mutates_args=())
def experts(x: Tensor, ids: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    _check_experts_args(x, ids, weights, w_gate_up, w_down)
    if x.is_cuda and kernels.supports(x, ids, weights, w_gate_up, w_down):
        return kernels.experts_forward(x, ids, weights, w_gate_up, w_down)
    return reference.experts_forward(x.contiguous(), ids, weights, w_gate_up, w_down)


@experts.register_fake
def _(x, ids, weights, w_gate_up, w_down):
    _check_experts_args(x, ids, weights, w_gate_up, w_down)
    return x.new_empty(x.shape)


@torch.library.custom_op("moe_fuse::experts_backward", mutates_args=())
def experts_backward(
    dy: Tensor, x: Tensor, ids: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if dy.is_cuda and kernels.supports(x, ids, weights, w_gate_up, w_down):
        grads = kernels.experts_backward(dy, x, ids, weights, w_gate_up, w_down)  # makes dy contiguous itself
    else:
        # The gradient of a sum arrives with stride 0: make it a real tensor first.
        grads = reference.experts_backward(dy.contiguous(), x.contiguous(), ids, weights, w_gate_up, w_down)
    return tuple(g.contiguous() for g in grads)


@experts_backward.register_fake
def _(dy, x, ids, weights, w_gate_up, w_down):
    fmt = torch.contiguous_format
    return tuple(torch.empty_like(t, memory_format=fmt) for t in (x, weights, w_gate_up, w_down))


def _experts_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _experts_backward(ctx, dy):
    x, ids, weights, w_gate_up, w_down = ctx.saved_tensors
    dx, d_weights, d_wgu, d_wd = torch.ops.moe_fuse.experts_backward(dy, x, ids, weights, w_gate_up, w_down)
    return dx, None, d_weights, d_wgu, d_wd


experts.register_autograd(_experts_backward, setup_context=_experts_setup_context)
