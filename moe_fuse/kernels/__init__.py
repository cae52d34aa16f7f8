"""Triton kernels of the experts block.

Where grouped_mm_path applies (CUDA sm90+, bf16), experts_backward and the forward that keeps h for it
run every GEMM through torch._grouped_mm (CUTLASS) with Triton kernels around it; the forward without h
(inference, activation-checkpointed layers) and everything else run the all-Triton kernels, whose
gate_up GEMM never writes h to memory.

Public:
    experts_forward(x, ids, weights, w_gate_up, w_down, *, save_h=False) -> y  (or (y, h, routing))
    experts_backward(dy, x, ids, weights, w_gate_up, w_down, h=None) -> (dx, d_weights, d_w_gate_up, d_w_down)
    supports(x, ids, weights, w_gate_up, w_down) -> bool
    route(ids, num_experts) -> Routing(order, counts, offsets, pos, token)
    softmax_topk(logits, top_k, renorm, weights_dtype) -> (weights, ids)
    softmax_topk_backward(d_logits | None, d_weights, logits, ids, renorm) -> d_logits

Importing this package does not import triton: triton fixes whether its own
library (tl.sum, tl.cumsum, ...) is compiled or interpreted when it is first
imported, from TRITON_INTERPRET. Deferring that import to the first call lets a
test session set the variable after importing moe_fuse. Our kernels themselves
are jitted at first launch (see _jit.py).
"""


def experts_forward(x, ids, weights, w_gate_up, w_down, *, save_h: bool = False):
    """See forward.experts_forward: same result as reference.experts_forward."""
    from . import grouped_mm_path
    from .forward import experts_forward as impl

    if save_h and ids.numel() and grouped_mm_path.applies(x, w_gate_up, w_down):
        impl = grouped_mm_path.experts_forward
    return impl(x, ids, weights, w_gate_up, w_down, save_h=save_h)


def experts_backward(dy, x, ids, weights, w_gate_up, w_down, h=None):
    """See backward.experts_backward: same result as reference.experts_backward (under the same ``supports``).

    h: the pre-activation ``experts_forward(save_h=True)`` kept, or None to recompute it.
    """
    from . import grouped_mm_path
    from .backward import experts_backward as impl

    if ids.numel() and grouped_mm_path.applies(x, w_gate_up, w_down, dy):
        impl = grouped_mm_path.experts_backward
    return impl(dy, x, ids, weights, w_gate_up, w_down, h)


def supports(x, ids, weights, w_gate_up, w_down) -> bool:
    """True when experts_forward handles these inputs (CUDA, or CPU under a usable Triton interpreter)."""
    from .forward import supports as impl

    return impl(x, ids, weights, w_gate_up, w_down)


def route(ids, num_experts: int):
    """See routing.route: the stable grouping of the rows of ids [T, k] by expert, on the device."""
    from .routing import route as impl

    return impl(ids, num_experts)


def softmax_topk(logits, top_k: int, renorm: bool, weights_dtype):
    """See router.softmax_topk: softmax(fp32) -> top-k -> optional renorm -> cast, in one kernel."""
    from .router import softmax_topk as impl

    return impl(logits, top_k, renorm, weights_dtype)


def softmax_topk_backward(d_logits, d_weights, logits, ids, renorm: bool):
    """See router.softmax_topk_backward: the gradient w.r.t. the router logits, in one kernel."""
    from .router import softmax_topk_backward as impl

    return impl(d_logits, d_weights, logits, ids, renorm)


def __getattr__(name):
    if name == "Routing":
        from .routing import Routing

        return Routing
    raise AttributeError(f"module 'moe_fuse.kernels' has no attribute {name!r}")


__all__ = ["Routing", "experts_backward", "experts_forward", "route", "softmax_topk", "softmax_topk_backward", "supports"]
