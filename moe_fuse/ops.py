"""The fused MoE custom ops: ``torch.ops.moe_fuse.router`` and ``torch.ops.moe_fuse.experts``.

Each op has a fake implementation (for tracing) and a registered autograd
formula whose backward is itself one opaque op, so AOTAutograd sees exactly
one fused node forward and one backward per MoE block; on the grouped_mm path
the experts' training backward is three (``experts_backward_down``, then
``experts_backward_gate_up`` and ``experts_backward_weight_gate_up``), so the
compiled backward frees the forward's h and aw after the first and can run
dW_gate_up when less is live.

Boundaries (the Triton kernels fill these in):
- router:  x, W_router -> logits, routing weights, expert ids
           (linear, softmax in fp32, top-k, optional renorm, cast).
- experts: x, ids, routing weights, W_gate_up, W_down, save_h, epilogue[, gate_up_bias] -> (y, h, xs, routing, aw)
           (routing metadata, permutation, gate_up GEMM, the epilogue (SwiGLU), down GEMM,
           weighted fixed-order combine over the k slots; h = the gate_up output,
           xs = the expert-sorted rows of x, routing = the routing buffer, aw = the
           weighted SwiGLU output, each kept for the backward when save_h and the
           kernels use it, else empty).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._prims_common import make_contiguous_strides_for

from . import dispatch, kernels, reference
from .spec import Epilogue

_LIB = torch.library.Library("moe_fuse", "FRAGMENT")


def _op(fn):
    """Define ``moe_fuse::<fn's name>`` with the schema of fn's annotations and fn as its kernel on every
    device; fn stays a plain function (its Python implementation, for direct calls).

    Not ``torch.library.custom_op``: that adds a wrapper per call (output aliasing checks, a frame with
    Dynamo disabled) costing ~16-28 us of host time on the H200 machines, against ~5-11 for a plain kernel
    registration (the op-overhead probe at da3be06); a training step calls four of these ops, and the
    30B step at T=4096 is host-bound. Every output here is a fresh tensor (nothing aliases an input).
    Fake and autograd implementations are registered by name, as for a custom op.
    """
    name = fn.__name__
    _LIB.define(name + torch.library.infer_schema(fn, mutates_args=()))
    _LIB.impl(name, fn, "CompositeExplicitAutograd")
    return fn

# --------------------------------------------------------------------------- router


@_op
def router(
    x: Tensor, weight: Tensor, top_k: int, renorm: bool, weights_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    if dispatch.router_on_kernels(x):
        # cuBLAS for the logits (bitwise eager's), one Triton kernel for softmax + top-k + renorm + cast.
        logits = torch.nn.functional.linear(x, weight)
        return (logits, *kernels.softmax_topk(logits, top_k, renorm, weights_dtype))
    return reference.router_forward(x.contiguous(), weight, top_k, renorm, weights_dtype)


@torch.library.register_fake("moe_fuse::router")
def _(x, weight, top_k, renorm, weights_dtype):
    T = x.shape[0]
    E = weight.shape[0]
    return (
        x.new_empty((T, E)),
        x.new_empty((T, top_k), dtype=weights_dtype),
        x.new_empty((T, top_k), dtype=torch.int64),
    )


@_op
def router_backward(
    d_logits: Tensor | None, d_weights: Tensor, x: Tensor, weight: Tensor, logits: Tensor, ids: Tensor, renorm: bool
) -> tuple[Tensor, Tensor]:
    """(dx, d_weight). d_logits: the gradient that reached the logits output directly, or None when none did."""
    if dispatch.router_on_kernels(x):
        # One Triton kernel back to the logits (torch needs a dozen small ones), then cuBLAS.
        d = kernels.softmax_topk_backward(d_logits, d_weights, logits, ids, renorm)
        return d @ weight, d.t() @ x
    if d_logits is None:
        d_logits = torch.zeros_like(logits)
    dx, dw = reference.router_backward(
        d_logits.contiguous(), d_weights.contiguous(), x.contiguous(), weight, logits, ids, renorm
    )
    return dx.contiguous(), dw.contiguous()


@torch.library.register_fake("moe_fuse::router_backward")
def _(d_logits, d_weights, x, weight, logits, ids, renorm):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(
        weight, memory_format=torch.contiguous_format
    )


def _router_setup_context(ctx, inputs, output):
    x, weight, top_k, renorm, weights_dtype = inputs
    logits, _, ids = output
    ctx.save_for_backward(x, weight, logits, ids)
    ctx.renorm = renorm
    # Outputs without a gradient arrive as None, not as zeros: the logits usually feed nothing that
    # needs one, and a zero d_logits would cost a fill and a read in every backward.
    ctx.set_materialize_grads(False)


def _router_backward(ctx, d_logits, d_weights, d_ids):
    x, weight, logits, ids = ctx.saved_tensors
    if d_weights is None:
        d_weights = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    dx, dw = torch.ops.moe_fuse.router_backward(d_logits, d_weights, x, weight, logits, ids, ctx.renorm)
    return dx, dw, None, None, None


torch.library.register_autograd("moe_fuse::router", _router_backward, setup_context=_router_setup_context)

# --------------------------------------------------------------------------- experts


def _epilogue(op: str, epilogue: str) -> Epilogue:
    """The op's ``epilogue`` string as an Epilogue (cached); ValueError naming the op for a bad one."""
    try:
        return Epilogue.decode(epilogue)
    except ValueError as e:
        raise ValueError(f"moe_fuse.{op}: {e}") from None


def _epilogue_string(epilogue: Epilogue | str) -> str:
    """The op's ``epilogue`` argument for an Epilogue or its string."""
    return epilogue.encode() if isinstance(epilogue, Epilogue) else epilogue


def _check_experts_args(x, ids, weights, w_gate_up, w_down, epilogue: Epilogue, gate_up_bias=None):
    # Kernels index with these shapes; a mismatch must be an error, not a wrong answer. (The epilogue checked
    # its own values when it was made.)
    T, H = x.shape
    E, two_i, h2 = w_gate_up.shape
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != T:
        raise ValueError(f"moe_fuse.experts: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be [T={T}, k]")
    if not epilogue.gated:
        activation = epilogue.activation
        if gate_up_bias is not None:
            raise ValueError(f"moe_fuse.experts: activation {activation!r} has no gate; swiglu_limit, glu_alpha, "
                             "gate_up_bias and interleaved are gate options")
        if h2 != H or tuple(w_down.shape) != (E, H, two_i):
            raise ValueError(
                f"moe_fuse.experts: weights of experts without a gate ({activation!r}) must be up [E, I, H] and down "
                f"[E, H, I]; got {tuple(w_gate_up.shape)} and {tuple(w_down.shape)} for hidden size {H}"
            )
        return
    if h2 != H or two_i % 2 or tuple(w_down.shape) != (E, H, two_i // 2):
        raise ValueError(
            f"moe_fuse.experts: weights must be gate_up [E, 2I, H] and down [E, H, I]; got "
            f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)} for hidden size {H}"
        )
    if gate_up_bias is not None and (tuple(gate_up_bias.shape) != (E, two_i) or not gate_up_bias.is_floating_point()):
        raise ValueError(f"moe_fuse.experts: gate_up_bias must be a float [E={E}, 2I={two_i}] tensor, got "
                         f"{tuple(gate_up_bias.shape)} {gate_up_bias.dtype}")


def _plan(x, ids, weights, w_gate_up, w_down, save_h, epilogue: Epilogue, gate_up_bias=None,
          keep_rows=True) -> dispatch.ExpertsPlan:
    return dispatch.plan(x, ids, weights, w_gate_up, w_down, save_h=save_h, keep_rows=keep_rows,
                         activation=epilogue.kernel_activation, gate_up_bias=gate_up_bias,
                         interleaved=epilogue.interleaved)


@_op
def experts(
    x: Tensor, ids: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor, save_h: bool = False,
    epilogue: str = "silu", gate_up_bias: Tensor | None = None, keep_rows: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y, h, xs, routing, aw): y, then what the backward reads instead of recomputing (``dispatch.plan``).

    With ``save_h``: h [T*k, 2I] is the pre-activation gate | up in expert order (the backward's first
    GEMM then costs 2 instead of 6 T*k*H*I FLOPs); on the CUDA kernels, routing is the int32 routing
    buffer (``kernels.route``'s, no re-routing in the backward), and on the grouped_mm path xs [T*k, H]
    the expert-sorted rows of x (no second gather) and, with ``config.keep_activation``, aw [T*k, I] the
    SwiGLU output times the routing weight (else the dSwiGLU pass writes it again). Each is empty where
    not kept. The rewrite saves them unless the block sits in an activation-checkpointed region, where
    recomputing inside the backward is cheaper than re-running the forward to rebuild them.
    keep_rows=False (the backend's ``moe_fuse.keep_rows`` option) keeps h and the routing but neither xs
    nor aw: T*k*H fewer elements held per layer (T*k*(H + I) with keep_activation), the backward gathers
    x's rows again.

    epilogue: what the experts compute between the GEMMs, ``Epilogue.encode()``'s string ("silu": SwiGLU;
    the clamped SwiGLU, the GPT-OSS-style gate, GeGLU, the softcapped SwiGLU, interleaved gate/up rows, or experts
    without a gate, "relu2": w_gate_up is then the up projection [E, I, H] and h [T*k, I]); see ``spec.Epilogue``.
    gate_up_bias [E, 2I] (GPT-OSS): added to the gate_up GEMM's output before the gate (h is kept without it).
    A down-projection bias is not the op's: ``experts_with_biases`` adds it to y.
    """
    ep = _epilogue("experts", epilogue)
    _check_experts_args(x, ids, weights, w_gate_up, w_down, ep, gate_up_bias)
    plan = _plan(x, ids, weights, w_gate_up, w_down, save_h, ep, gate_up_bias, keep_rows)
    lim = ep.kernel_kwargs(gate_up_bias)
    if plan.routing_size:
        y, h, routing, *rows = dispatch.experts_forward(
            x, ids, weights, w_gate_up, w_down, save_h=True, keep_rows=bool(plan.rows), path=plan.forward, **lim
        )
        xs = rows[0] if plan.rows else _empty(x, x.shape[1])
        aw = rows[1] if plan.act_rows else _empty(w_down, w_down.shape[2])
        return y, h, xs, routing.buf, aw
    if plan.forward != "reference":  # without save_h
        y = dispatch.experts_forward(x, ids, weights, w_gate_up, w_down, path=plan.forward, **lim)
        h = _empty(w_gate_up, w_gate_up.shape[1])
    elif save_h:
        y, h = reference.experts_forward(x.contiguous(), ids, weights, w_gate_up, w_down, save_h=True, **lim)
    else:
        y = reference.experts_forward(x.contiguous(), ids, weights, w_gate_up, w_down, **lim)
        h = _empty(w_gate_up, w_gate_up.shape[1])
    return y, h, _empty(x, x.shape[1]), _empty(ids, None), _empty(w_down, w_down.shape[2])


def experts_with_biases(
    x: Tensor, ids: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor, gate_up_bias: Tensor | None,
    down_bias: Tensor | None, save_h: bool = False, epilogue: Epilogue | str = "silu",
) -> Tensor:
    """y of experts whose projections have biases (GPT-OSS): the gate_up bias inside the op, the down bias [E, H]
    added by ``add_down_bias``. Both biases get gradients; either may be None. epilogue: the op's, as an Epilogue
    or its string."""
    E, H = w_down.shape[0], w_down.shape[1]
    if down_bias is not None and tuple(down_bias.shape) != (E, H):
        raise ValueError(f"moe_fuse.experts: down_bias must be [E={E}, H={H}], got {tuple(down_bias.shape)}")
    y = torch.ops.moe_fuse.experts.default(x, ids, weights, w_gate_up, w_down, save_h, _epilogue_string(epilogue),
                                           gate_up_bias)[0]
    if down_bias is None:
        return y
    return add_down_bias(y, ids, weights, down_bias, E, x.dtype)


def add_down_bias(y: Tensor, ids: Tensor, weights: Tensor, down_bias: Tensor, num_experts: int, dtype: torch.dtype):
    """y + ``reference.down_bias_term`` in fp32 (fp64 for fp64 models), cast to dtype (y's). Autograd takes its
    backward: two small GEMMs and a gather, deterministic. Traceable by torch.fx: only the tensors are values."""
    ct = torch.promote_types(dtype, torch.float32)
    return (y.to(ct) + reference.down_bias_term(ids, weights, down_bias.to(ct), num_experts)).to(dtype)


def _empty(like, cols):
    """An empty saved value: [0, cols] in like's dtype, or an empty int32 vector for cols None."""
    if cols is None:
        return like.new_empty((0,), dtype=torch.int32)
    return like.new_empty((0, cols))


@torch.library.register_fake("moe_fuse::experts")
def _(x, ids, weights, w_gate_up, w_down, save_h=False, epilogue="silu", gate_up_bias=None, keep_rows=True):
    ep = _epilogue("experts", epilogue)
    _check_experts_args(x, ids, weights, w_gate_up, w_down, ep, gate_up_bias)
    plan = _plan(x, ids, weights, w_gate_up, w_down, save_h, ep, gate_up_bias, keep_rows)
    return (
        x.new_empty(x.shape),
        w_gate_up.new_empty((plan.h_rows, w_gate_up.shape[1])),
        x.new_empty((plan.rows, x.shape[1])),
        ids.new_empty((plan.routing_size,), dtype=torch.int32),
        w_down.new_empty((plan.act_rows, w_down.shape[2])),
    )


@_op
def experts_backward(
    dy: Tensor, x: Tensor, ids: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor, h: Tensor,
    xs: Tensor, routing: Tensor, aw: Tensor, epilogue: str, gate_up_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, d_weights, d_w_gate_up, d_w_down, d_gate_up_bias); the last is empty without a gate_up_bias.

    h, xs, routing, aw: what the forward kept (``experts``), each empty when not kept (recomputed).
    epilogue, gate_up_bias: the forward's (the epilogue without a default: a backward graph always names it)."""
    ep = _epilogue("experts_backward", epilogue)
    gate = ep.kernel_kwargs(gate_up_bias)
    if dispatch.on_kernels(x, ids, weights, w_gate_up, w_down, gate["activation"], gate_up_bias, ep.interleaved):
        S, E = ids.shape[0] * ids.shape[1], w_gate_up.shape[0]
        grads = dispatch.experts_backward(  # makes dy contiguous itself
            dy, x, ids, weights, w_gate_up, w_down, h if h.numel() else None,
            routing=kernels.routing_from_buffer(routing, S, E) if routing.numel() else None,
            xs=xs if xs.numel() else None, aw=aw if aw.numel() else None, **gate,
        )
    else:
        # The reference recomputes h in fp32. The gradient of a sum arrives with stride 0: make it a real tensor first.
        grads = reference.experts_backward(dy.contiguous(), x.contiguous(), ids, weights, w_gate_up, w_down, **gate)
    dx, d_weights, d_wgu, d_wd, *d_bias = grads
    d_bias = d_bias[0].contiguous() if d_bias else w_gate_up.new_empty((0,))
    return (dx.contiguous(), d_weights.contiguous(), in_layout_of(d_wgu, w_gate_up), in_layout_of(d_wd, w_down),
            d_bias)


def _check_split(name, x, ids, w_gate_up, w_down, dy):
    if not dispatch.uses_grouped_mm(x, ids, w_gate_up, w_down, dy):
        raise RuntimeError(f"moe_fuse.{name}: a half of experts_backward on the grouped_mm path only (CUDA sm90+, "
                           "bf16: dispatch.uses_grouped_mm); elsewhere call moe_fuse.experts_backward")


@_op
def experts_backward_down(
    dy: Tensor, x: Tensor, ids: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor, h: Tensor,
    routing: Tensor, aw: Tensor, epilogue: str, gate_up_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(d_h, d_weights, d_w_down): ``experts_backward`` up to the gradient of h, on the grouped_mm path, from the
    forward's h, routing and aw (empty: written again). Nothing after it reads h or aw (``_experts_backward``)."""
    from .kernels import grouped_mm_path

    ep = _epilogue("experts_backward_down", epilogue)
    _check_split("experts_backward_down", x, ids, w_gate_up, w_down, dy)
    dh, d_weights, d_wd = grouped_mm_path.backward_down(
        dy, ids.contiguous(), weights, w_down, h, kernels.routing_from_buffer(routing, ids.numel(), w_down.shape[0]),
        aw if aw.numel() else None, **ep.kernel_kwargs(gate_up_bias), ragged=dispatch.ragged(ids.numel()),
    )
    return dh, d_weights.contiguous(), in_layout_of(d_wd, w_down)


@torch.library.register_fake("moe_fuse::experts_backward_down")
def _(dy, x, ids, weights, w_gate_up, w_down, h, routing, aw, epilogue, gate_up_bias=None):
    _epilogue("experts_backward_down", epilogue)
    fmt = torch.contiguous_format
    return (torch.empty_like(h, dtype=dy.dtype, memory_format=fmt), torch.empty_like(weights, memory_format=fmt),
            weight_layout(w_down))


@_op
def experts_backward_gate_up(
    dh: Tensor, x: Tensor, ids: Tensor, w_gate_up: Tensor, w_down: Tensor, routing: Tensor,
    gate_up_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(dx, d_gate_up_bias): ``experts_backward``'s dx from ``experts_backward_down``'s d_h, with the forward's
    routing. d_gate_up_bias is empty without a gate_up_bias."""
    from .kernels import grouped_mm_path

    _check_split("experts_backward_gate_up", x, ids, w_gate_up, w_down, dh)
    dx, d_bias = grouped_mm_path.backward_gate_up(
        dh, x, ids.contiguous(), w_gate_up, kernels.routing_from_buffer(routing, ids.numel(), w_gate_up.shape[0]),
        bias_dtype=None if gate_up_bias is None else gate_up_bias.dtype, ragged=dispatch.ragged(ids.numel()),
    )
    d_bias = w_gate_up.new_empty((0,)) if d_bias is None else d_bias.contiguous()
    return dx.contiguous(), d_bias


@torch.library.register_fake("moe_fuse::experts_backward_gate_up")
def _(dh, x, ids, w_gate_up, w_down, routing, gate_up_bias=None):
    d_bias = w_gate_up.new_empty(gate_up_bias.shape) if gate_up_bias is not None else w_gate_up.new_empty((0,))
    return torch.empty_like(x, memory_format=torch.contiguous_format), d_bias


@_op
def experts_backward_weight_gate_up(
    dh: Tensor, x: Tensor, ids: Tensor, w_gate_up: Tensor, w_down: Tensor, xs: Tensor, routing: Tensor,
) -> Tensor:
    """``experts_backward``'s d_w_gate_up from ``experts_backward_down``'s d_h and the forward's xs (empty:
    gathered again) and routing. An op of its own: nothing else in the layer's backward reads its [E, 2I, H]
    result, so the compiled backward may run it later, when less is live."""
    from .kernels import grouped_mm_path

    _check_split("experts_backward_weight_gate_up", x, ids, w_gate_up, w_down, dh)
    d_wgu = grouped_mm_path.backward_weight_gate_up(
        dh, x, ids.contiguous(), w_gate_up, kernels.routing_from_buffer(routing, ids.numel(), w_gate_up.shape[0]),
        xs if xs.numel() else None,
    )
    return in_layout_of(d_wgu, w_gate_up)


@torch.library.register_fake("moe_fuse::experts_backward_weight_gate_up")
def _(dh, x, ids, w_gate_up, w_down, xs, routing):
    return weight_layout(w_gate_up)


def weight_layout(w: Tensor) -> Tensor:
    """An empty tensor shaped like expert weights w, with w's strides where w is dense (a contiguous tensor, or
    the transpose of one over its last two dims: a model that stores [E, in, out]), else contiguous.

    The weight gradients come in that layout, so the gradient of a transposed view reaches the parameter
    without a copy. The real and the fake implementation both ask this."""
    return w.new_empty_strided(w.shape, _layout_strides(w))


def _layout_strides(w: Tensor) -> tuple:
    if kernels.transposed(w):
        E, M, N = w.shape
        return (M * N, 1, M)
    if all(type(n) is int for n in w.shape):  # every real call: torch's rule below took 8.7 us a call, this 1.3
        strides, step = [], 1
        for n in reversed(w.shape):
            strides.append(step)
            step *= max(n, 1)
        return tuple(reversed(strides))
    # torch's own rule for a contiguous tensor (size-1 and size-0 dims included, symbolic sizes kept)
    return tuple(make_contiguous_strides_for(w.shape))


def in_layout_of(g: Tensor, w: Tensor) -> Tensor:
    """The gradient g of expert weights w in ``weight_layout(w)``: g itself where the kernels wrote that layout
    (nothing allocated), else a copy."""
    if g.stride() == _layout_strides(w):
        return g
    return weight_layout(w).copy_(g)


@torch.library.register_fake("moe_fuse::experts_backward")
def _(dy, x, ids, weights, w_gate_up, w_down, h, xs, routing, aw, epilogue, gate_up_bias=None):
    _epilogue("experts_backward", epilogue)
    fmt = torch.contiguous_format
    d_bias = w_gate_up.new_empty(gate_up_bias.shape) if gate_up_bias is not None else w_gate_up.new_empty((0,))
    return (torch.empty_like(x, memory_format=fmt), torch.empty_like(weights, memory_format=fmt),
            weight_layout(w_gate_up), weight_layout(w_down), d_bias)


def _experts_setup_context(ctx, inputs, output):
    # every argument, defaults filled in (keep_rows only shapes the outputs)
    x, ids, weights, w_gate_up, w_down, _save_h, epilogue, bias, _keep_rows = inputs
    ctx.save_for_backward(x, ids, weights, w_gate_up, w_down, *output[1:], *([bias] if bias is not None else []))
    ctx.epilogue = epilogue


def _experts_backward(ctx, dy, _d_h, _d_xs, _d_routing, _d_aw):
    x, ids, weights, w_gate_up, w_down, h, xs, routing, aw, *bias = ctx.saved_tensors
    if dy is None:  # only the saved values were used: nothing flows back (they are internal)
        dy = torch.zeros_like(x)
    bias = bias[0] if bias else None
    if dispatch.split_backward(x, ids, w_gate_up, w_down, dy, h, routing):
        # Three ops: the compiled backward frees h and aw, which only the first reads, before the second allocates
        # its [S, H] GEMM output (the layer step's peak: tests/gpu/test_memory_gpu.py); dW_gate_up, which nothing
        # else reads, apart, so that Inductor's memory-aware ordering may run it after later layers' work.
        dh, d_weights, d_wd = torch.ops.moe_fuse.experts_backward_down(
            dy, x, ids, weights, w_gate_up, w_down, h, routing, aw, ctx.epilogue, bias
        )
        dx, d_bias = torch.ops.moe_fuse.experts_backward_gate_up(dh, x, ids, w_gate_up, w_down, routing, bias)
        d_wgu = torch.ops.moe_fuse.experts_backward_weight_gate_up(dh, x, ids, w_gate_up, w_down, xs, routing)
    else:
        dx, d_weights, d_wgu, d_wd, d_bias = torch.ops.moe_fuse.experts_backward(
            dy, x, ids, weights, w_gate_up, w_down, h, xs, routing, aw, ctx.epilogue, bias
        )
    # ids, then save_h, epilogue, gate_up_bias, keep_rows
    return dx, None, d_weights, d_wgu, d_wd, None, None, d_bias if bias is not None else None, None


torch.library.register_autograd(
    "moe_fuse::experts", _experts_backward, setup_context=_experts_setup_context
)
