"""Triton kernels of the experts block.

Where grouped_mm_path applies (CUDA sm90+, bf16), experts_backward and the forward that keeps h for it
run every GEMM through torch._grouped_mm (CUTLASS) with Triton kernels around it, and so does the forward
without h (inference, activation-checkpointed layers) when the routing weights are wider than x
(``inference_on_grouped_mm``); everything else runs the all-Triton kernels, whose gate_up GEMM never
writes h to memory.

Public:
    experts_forward(x, ids, weights, w_gate_up, w_down, *, save_h=False, keep_rows=False, swiglu_limit=None,
                    glu_alpha=None, activation="silu", gate_up_bias=None, interleaved=False)
        -> y  (or (y, h, routing), or (y, h, routing, xs | None, aw | None))
    experts_backward(dy, x, ids, weights, w_gate_up, w_down, h=None, *, routing=None, xs=None, aw=None,
                     swiglu_limit=None, glu_alpha=None, activation="silu", gate_up_bias=None, interleaved=False)
        -> (dx, d_weights, d_w_gate_up, d_w_down[, d_gate_up_bias])
    supports(x, ids, weights, w_gate_up, w_down, *, extras=False, gated=True) -> bool
    grouped_mm_only(activation, gate_up_bias, interleaved) -> bool
    uses_grouped_mm(x, ids, w_gate_up, w_down, *others) -> bool
    route(ids, num_experts) -> Routing(order, counts, offsets, pos, token, buf)
    routing_buffer_size(S, num_experts), routing_from_buffer(buf, S, num_experts)
    softmax_topk(logits, top_k, renorm, weights_dtype) -> (weights, ids)
    softmax_topk_backward(d_logits | None, d_weights, logits, ids, renorm) -> d_logits

Importing this package does not import triton: triton fixes whether its own
library (tl.sum, tl.cumsum, ...) is compiled or interpreted when it is first
imported, from TRITON_INTERPRET. Deferring that import to the first call lets a
test session set the variable after importing moe_fuse. Our kernels themselves
are jitted at first launch (see _jit.py).
"""


def transposed(w) -> bool:
    """Expert weights given as the transpose of a contiguous [E, in, out] tensor (models that store them so:
    Aria, GPT-OSS), not contiguous themselves. Their weight gradients come in that layout too."""
    return w.dim() == 3 and not w.is_contiguous() and w.transpose(1, 2).is_contiguous()


def grouped_mm_only(activation: str, gate_up_bias, interleaved: bool) -> bool:
    """Whether these experts are what only grouped_mm_path computes: a gate_up bias, interleaved gate/up rows,
    experts without a gate, the softcapped SwiGLU (the fused Triton GEMMs have none of these in their epilogues)."""
    from ..reference import gated, softcaps

    return gate_up_bias is not None or interleaved or not gated(activation) or softcaps(activation) is not None


def uses_grouped_mm(x, ids, w_gate_up, w_down, *others) -> bool:
    """True when the training forward (save_h) and the backward of these inputs take grouped_mm_path.

    Reads metadata only (the op's fake implementation asks it too). ``others``: more tensors that
    must be bf16 (the backward's dy).
    """
    from . import grouped_mm_path

    return ids.numel() > 0 and grouped_mm_path.applies(x, w_gate_up, w_down, *others)


# Where the forward without h (inference, checkpointed layers) runs: None picks by `inference_on_grouped_mm`;
# True / False force grouped_mm_path / the fused Triton GEMMs (bench A/B runs).
INFERENCE_GROUPED_MM: bool | None = None


def inference_on_grouped_mm(x, weights) -> bool:
    """Whether the forward without h takes grouped_mm_path (where it applies) rather than the fused Triton GEMMs.

    The fused forward keeps each token's k weighted slots in the promoted dtype of the weights and the expert
    outputs, as the reference sums them: routing weights wider than x (Mixtral, DeepSeek-V2, GLM-4.5 keep them
    in fp32) double those [T*k, H] bytes. grouped_mm_path folds the weight in before the down GEMM and writes
    the slots in x's dtype. Measured on the H200 at T=8192 (bench/PERF_LOG.md, 2026-12-04): grouped_mm_path
    2-8% faster for those three; with weights in x's dtype, from 1% faster to 4% slower, and the fused forward
    holds less memory there (no h)."""
    if INFERENCE_GROUPED_MM is not None:
        return INFERENCE_GROUPED_MM
    return weights.dtype.itemsize > x.dtype.itemsize


def experts_forward(x, ids, weights, w_gate_up, w_down, *, save_h: bool = False, keep_rows: bool = False,
                    swiglu_limit: float | None = None, glu_alpha: float | None = None, activation: str = "silu",
                    gate_up_bias=None, interleaved: bool = False):
    """See forward.experts_forward: same result as reference.experts_forward (with its swiglu_limit, glu_alpha,
    activation, gate_up_bias, interleaved; the last two and the activations without a gate on grouped_mm_path
    only: ``supports(extras=True)``).

    save_h: (y, h, routing); with keep_rows too: (y, h, routing, xs, aw), on grouped_mm_path the
    weight gradients' operands its backward reads (xs the expert-sorted rows of x, aw the weighted
    SwiGLU output), None each on the Triton path (whose GEMMs gather and recompute).
    """
    from . import grouped_mm_path
    from .forward import experts_forward as impl

    # Weights stored transposed take the path without h too: the fused Triton GEMMs would read them through
    # pointer loads (their TMA descriptors need the contiguous layout).
    stored_transposed = transposed(w_gate_up) or transposed(w_down)
    extras = grouped_mm_only(activation, gate_up_bias, interleaved)
    on_path = save_h or stored_transposed or extras or inference_on_grouped_mm(x, weights)
    if on_path and uses_grouped_mm(x, ids, w_gate_up, w_down):
        return grouped_mm_path.experts_forward(
            x, ids, weights, w_gate_up, w_down, save_h=save_h, keep_rows=keep_rows, swiglu_limit=swiglu_limit,
            glu_alpha=glu_alpha, activation=activation, gate_up_bias=gate_up_bias, interleaved=interleaved,
        )
    if extras:
        raise ValueError("experts_forward: gate_up_bias, interleaved gate/up rows, experts without a gate and the "
                         "softcapped SwiGLU run on grouped_mm_path only (CUDA sm90+, bf16); elsewhere use "
                         "reference.experts_forward")
    out = impl(x, ids, weights, w_gate_up, w_down, save_h=save_h, swiglu_limit=swiglu_limit, glu_alpha=glu_alpha,
               activation=activation)
    return (*out, None, None) if save_h and keep_rows else out


def experts_backward(dy, x, ids, weights, w_gate_up, w_down, h=None, *, routing=None, xs=None, aw=None,
                     swiglu_limit: float | None = None, glu_alpha: float | None = None, activation: str = "silu",
                     gate_up_bias=None, interleaved: bool = False):
    """See backward.experts_backward: same result as reference.experts_backward (under the same ``supports``; with
    gate_up_bias, (..., d_gate_up_bias) too, on grouped_mm_path only, as interleaved).

    h, routing, xs, aw: what ``experts_forward(save_h=True, keep_rows=True)`` kept, or None to recompute.
    """
    from . import grouped_mm_path
    from .backward import experts_backward as impl

    if uses_grouped_mm(x, ids, w_gate_up, w_down, dy):
        return grouped_mm_path.experts_backward(
            dy, x, ids, weights, w_gate_up, w_down, h, routing=routing, xs=xs, aw=aw, swiglu_limit=swiglu_limit,
            glu_alpha=glu_alpha, activation=activation, gate_up_bias=gate_up_bias, interleaved=interleaved,
        )
    if grouped_mm_only(activation, gate_up_bias, interleaved):
        raise ValueError("experts_backward: gate_up_bias, interleaved gate/up rows, experts without a gate and the "
                         "softcapped SwiGLU run on grouped_mm_path only (CUDA sm90+, bf16); elsewhere use "
                         "reference.experts_backward")
    return impl(dy, x, ids, weights, w_gate_up, w_down, h, routing=routing, swiglu_limit=swiglu_limit,
                glu_alpha=glu_alpha, activation=activation)


def supports(x, ids, weights, w_gate_up, w_down, *, extras: bool = False, gated: bool = True) -> bool:
    """True when experts_forward handles these inputs (CUDA, or CPU under a usable Triton interpreter).

    extras: with a gate_up bias, interleaved gate/up rows or no gate (an up projection only), which only
    grouped_mm_path computes (the fused Triton GEMMs have none of these in their epilogues). gated False: the
    weights are an up projection [E, I, H] and [E, H, I] (an extra too)."""
    from .forward import supports as impl

    extras = extras or not gated
    return impl(x, ids, weights, w_gate_up, w_down, gated=gated) and (
        not extras or uses_grouped_mm(x, ids, w_gate_up, w_down))


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


__all__ = [
    "Routing", "experts_backward", "experts_forward", "grouped_mm_only", "route", "routing_buffer_size",
    "routing_from_buffer", "softmax_topk", "softmax_topk_backward", "supports", "transposed", "uses_grouped_mm",
]
