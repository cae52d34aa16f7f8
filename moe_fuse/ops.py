"""The fused MoE custom ops: ``torch.ops.moe_fuse.router`` and ``torch.ops.moe_fuse.experts``.

Each op has a fake implementation (for tracing) and a registered autograd
formula whose backward is itself one opaque op, so AOTAutograd sees exactly
one fused node forward and one backward per MoE block.

Boundaries (the Triton kernels fill these in):
- router:  x, W_router -> logits, routing weights, expert ids
           (linear, softmax in fp32, top-k, optional renorm, cast).
- experts: x, ids, routing weights, W_gate_up, W_down, save_h -> (y, h)
           (routing metadata, permutation, gate_up GEMM, SwiGLU, down GEMM,
           weighted fixed-order combine over the k slots; h = the gate_up output
           kept for the backward when save_h, else empty).
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
    d_logits: Tensor | None, d_weights: Tensor, x: Tensor, weight: Tensor, logits: Tensor, ids: Tensor, renorm: bool
) -> tuple[Tensor, Tensor]:
    """(dx, d_weight). d_logits: the gradient that reached the logits output directly, or None when none did."""
    if x.is_cuda:
        # One Triton kernel back to the logits (torch needs a dozen small ones), then cuBLAS.
        d = kernels.softmax_topk_backward(d_logits, d_weights, logits, ids, renorm)
        return d @ weight, d.t() @ x
    if d_logits is None:
        d_logits = torch.zeros_like(logits)
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
def experts(
    x: Tensor, ids: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor, save_h: bool = False
) -> tuple[Tensor, Tensor]:
    """(y, h). With ``save_h``, h [T*k, 2I] is the pre-activation gate | up in expert order, which the
    backward reads instead of recomputing it (2 instead of 6 T*k*H*I FLOPs in its first GEMM); without,
    h is empty [0, 2I] and the backward recomputes. The rewrite saves h unless the block sits in an
    activation-checkpointed region, where recomputing inside the backward is cheaper than re-running
    the forward to rebuild h.
    """
    _check_experts_args(x, ids, weights, w_gate_up, w_down)
    if x.is_cuda and kernels.supports(x, ids, weights, w_gate_up, w_down):
        if save_h:
            y, h, _ = kernels.experts_forward(x, ids, weights, w_gate_up, w_down, save_h=True)
            return y, h
        return kernels.experts_forward(x, ids, weights, w_gate_up, w_down), _no_h(w_gate_up)
    if save_h:
        return reference.experts_forward(x.contiguous(), ids, weights, w_gate_up, w_down, save_h=True)
    return reference.experts_forward(x.contiguous(), ids, weights, w_gate_up, w_down), _no_h(w_gate_up)


def _no_h(w_gate_up):
    return w_gate_up.new_empty((0, w_gate_up.shape[1]))


@experts.register_fake
def _(x, ids, weights, w_gate_up, w_down, save_h=False):
    _check_experts_args(x, ids, weights, w_gate_up, w_down)
    rows = ids.shape[0] * ids.shape[1] if save_h else 0
    return x.new_empty(x.shape), w_gate_up.new_empty((rows, w_gate_up.shape[1]))


@torch.library.custom_op("moe_fuse::experts_backward", mutates_args=())
def experts_backward(
    dy: Tensor, x: Tensor, ids: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor, h: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """h: the forward's saved pre-activation, or empty (recompute)."""
    if dy.is_cuda and kernels.supports(x, ids, weights, w_gate_up, w_down):
        saved = h if h.numel() else None
        grads = kernels.experts_backward(dy, x, ids, weights, w_gate_up, w_down, saved)  # makes dy contiguous itself
    else:
        # The reference recomputes h in fp32. The gradient of a sum arrives with stride 0: make it a real tensor first.
        grads = reference.experts_backward(dy.contiguous(), x.contiguous(), ids, weights, w_gate_up, w_down)
    return tuple(g.contiguous() for g in grads)


@experts_backward.register_fake
def _(dy, x, ids, weights, w_gate_up, w_down, h):
    fmt = torch.contiguous_format
    return tuple(torch.empty_like(t, memory_format=fmt) for t in (x, weights, w_gate_up, w_down))


def _experts_setup_context(ctx, inputs, output):
    x, ids, weights, w_gate_up, w_down, _save_h = inputs
    ctx.save_for_backward(x, ids, weights, w_gate_up, w_down, output[1])


def _experts_backward(ctx, dy, _d_h):
    x, ids, weights, w_gate_up, w_down, h = ctx.saved_tensors
    if dy is None:  # only h was used: nothing flows back (h is an internal saved value)
        dy = torch.zeros_like(x)
    dx, d_weights, d_wgu, d_wd = torch.ops.moe_fuse.experts_backward(dy, x, ids, weights, w_gate_up, w_down, h)
    return dx, None, d_weights, d_wgu, d_wd, None


experts.register_autograd(_experts_backward, setup_context=_experts_setup_context)
