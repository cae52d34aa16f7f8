"""Triton kernels of the router and the experts block. Which of them run is decided in ``moe_fuse.dispatch``.

    routing.py          route(ids, E): the stable grouping of the rows by expert, on the device (no host sync)
    router.py           softmax_topk (+ backward): softmax -> top-k -> renorm -> cast in one kernel
    forward.py          the portable fused forward: route -> gate_up GEMM with the activation in its epilogue
                        (grouped_gemm.py) -> down GEMM -> fixed-order combine (combine.py)
    backward.py         its backward: dgrad with dSwiGLU, dx, weight gradients
    grouped_mm_path.py  the Hopper bf16 path: GEMMs on expert-sorted rows (torch._grouped_mm or ragged_gemm.py)
                        with the row copies (permute.py), the activation passes (ungated.py for experts without
                        a gate) and the combines around them
    _jit.py             lazy_jit: kernels jitted at first launch, compiled or interpreted by TRITON_INTERPRET then;
                        jit_helper: device functions jitted with the kernel that calls them
    jit_math.py         the shared activation math (SwiGLU and its forms, dSwiGLU, clamps, softcap tanh, softmax)
    jit_tiles.py        the grouped GEMMs' program -> tile -> expert map

Importing this package does not import triton: triton fixes whether its own library (tl.sum, tl.cumsum, ...) is
compiled or interpreted when it is first imported, from TRITON_INTERPRET. Deferring that import to the first
call lets a test session set the variable after importing moe_fuse.
"""


def transposed(w) -> bool:
    """Expert weights given as the transpose of a contiguous [E, in, out] tensor (models that store them so:
    Aria, GPT-OSS), not contiguous themselves. Their weight gradients come in that layout too."""
    return w.dim() == 3 and not w.is_contiguous() and w.transpose(1, 2).is_contiguous()


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


def routing_buffer_size(S: int, num_experts: int) -> int:
    """See routing.buffer_size: int32 elements of a Routing's one buffer (what a forward keeps)."""
    from .routing import buffer_size

    return buffer_size(S, num_experts)


def routing_from_buffer(buf, S: int, num_experts: int):
    """See routing.from_buffer: the Routing a kept buffer holds."""
    from .routing import from_buffer

    return from_buffer(buf, S, num_experts)


def __getattr__(name):
    if name == "Routing":
        from .routing import Routing

        return Routing
    raise AttributeError(f"module 'moe_fuse.kernels' has no attribute {name!r}")


__all__ = ["Routing", "route", "routing_buffer_size", "routing_from_buffer", "softmax_topk", "softmax_topk_backward",
           "transposed"]
