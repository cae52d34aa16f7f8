"""Triton kernels of the experts block (forward).

Public:
    experts_forward(x, ids, weights, w_gate_up, w_down, *, save_h=False) -> y  (or (y, h, routing))
    supports(x, ids, weights, w_gate_up, w_down) -> bool
    route(ids, num_experts) -> Routing(order, counts, offsets)

Whether kernels run compiled or in the Triton interpreter is read from
TRITON_INTERPRET at each call, not at import (see _jit.py).
"""

from .forward import Routing, experts_forward, route, supports

__all__ = ["Routing", "experts_forward", "route", "supports"]
