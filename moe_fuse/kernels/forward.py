"""The experts block forward from the Triton kernels: route -> gate_up -> down -> combine."""

from __future__ import annotations

import torch

from ..reference import softcaps
from ._jit import interpreter_usable
from .combine import combine
from .grouped_gemm import down, gate_up
from .routing import Routing, route

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supports(x, ids, weights, w_gate_up, w_down, *, gated: bool = True) -> bool:
    """True when ``experts_forward`` handles these inputs; the op falls back to the reference otherwise.

    gated False: experts without a gate, w_gate_up the up projection [E, I, H] (only grouped_mm_path computes them:
    ``dispatch.supports``)."""
    tensors = (x, ids, weights, w_gate_up, w_down)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    device = x.device
    if any(t.device != device for t in tensors):
        return False
    if device.type == "cpu":
        if not interpreter_usable():
            return False
    elif device.type != "cuda":
        return False
    if x.dtype not in FLOAT_DTYPES or weights.dtype not in FLOAT_DTYPES:
        return False
    # The reference multiplies the gate_up output by w_down directly: both must share a dtype.
    if w_gate_up.dtype not in FLOAT_DTYPES or w_down.dtype != w_gate_up.dtype:
        return False
    if ids.dtype not in (torch.int64, torch.int32):
        return False
    if x.dim() != 2 or ids.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        return False
    T, H = x.shape
    E, two_i, h2 = w_gate_up.shape
    if ids.shape != weights.shape or ids.shape[0] != T or h2 != H or (gated and two_i % 2):
        return False
    if tuple(w_down.shape) != (E, H, two_i // 2 if gated else two_i):
        return False
    # Empty hidden or intermediate sizes or no experts: nothing for a GEMM kernel to do; leave them to the reference.
    return H > 0 and two_i > 0 and E > 0


def experts_forward(x, ids, weights, w_gate_up, w_down, *, save_h: bool = False, swiglu_limit: float | None = None,
                    glu_alpha: float | None = None, activation: str = "silu"):
    """Same result as ``reference.experts_forward``; with ``save_h`` also returns (h, routing).

    x [T, H], ids [T, k] (expert of each slot; ids >= E are expert-parallel
    sentinels that contribute zero, as in the reference), weights [T, k], w_gate_up [E, 2I, H]
    (gate rows first), w_down [E, H, I]. Returns y [T, H] in x.dtype, or
    ``(y, h, routing)`` where h [S, 2I] is the pre-activation (gate | up) in
    sorted order (row p belongs to ``routing.order[p]``) in the weights' dtype.
    """
    if softcaps(activation) is not None:
        raise ValueError("experts_forward: the softcapped SwiGLU runs on grouped_mm_path only")
    T, H = x.shape
    k = ids.shape[1]
    E = w_gate_up.shape[0]
    routing = route(ids, E)
    a, h = gate_up(x, routing, w_gate_up, k, save_h=save_h, swiglu_limit=swiglu_limit, glu_alpha=glu_alpha,
                   activation=activation)
    # The reference multiplies the expert output (weights' dtype) by the routing
    # weight with type promotion and sums in that dtype: keep the slots there.
    slot_dtype = torch.promote_types(w_down.dtype, weights.dtype)
    slots = down(a, routing, weights, w_down, slot_dtype)
    y = combine(slots, ids, E, x.dtype)
    if save_h:
        return y, h, routing
    return y


__all__ = ["Routing", "experts_forward", "route", "supports"]
