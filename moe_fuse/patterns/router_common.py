"""FX helpers shared by the router patterns beyond softmax -> top-k (router_sigmoid, router_topk_softmax,
router_unmatched): more op spellings, fp32 upcasts, and where a router's logits come from.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..pipeline.candidate import Rejection
from ..pipeline.graph import NoMatch, arg, dtype_of, expect, op_name, same_size, shape_of

# Spellings graph.op_name does not know (it is shared; these only matter to the routers).
_EXTRA_NAMES = {
    operator.add: "add",
    torch.add: "add",
    operator.sub: "sub",
    torch.sub: "sub",
    torch.sigmoid: "sigmoid",
    F.sigmoid: "sigmoid",
    torch.gather: "gather",
    operator.invert: "invert",
    torch.bitwise_not: "invert",
    torch.tanh: "tanh",
    F.logsigmoid: "logsigmoid",
    F.log_softmax: "log_softmax",
    torch.log_softmax: "log_softmax",
    torch.exp: "exp",
    F.relu: "relu",
    torch.relu: "relu",
    F.softplus: "softplus",
    torch.zeros_like: "zeros_like",
    torch.full_like: "full_like",
    torch.detach: "detach",
}


def name(node) -> str | None:
    """graph.op_name, plus the spellings routers use that it does not know."""
    got = op_name(node)
    if got is None and isinstance(node, fx.Node) and node.op == "call_function":
        try:
            got = _EXTRA_NAMES.get(node.target)
        except TypeError:
            got = None
    return got


def is_(node, *names) -> bool:
    return name(node) in names


def last_dim(dim, ndim: int, node: fx.Node):
    if dim not in (-1, ndim - 1):
        raise NoMatch(f"{name(node)} over dim {dim}, expected the last dim", node)


def is_fp32_upcast(node) -> bool:
    """``t.float()``, ``t.to(torch.float32)``, ``t.type(torch.float32)``."""
    if not isinstance(node, fx.Node) or node.kwargs:
        return False
    if is_(node, "float"):
        return len(node.args) == 1
    if is_(node, "to", "type"):
        return node.args[1:] == (torch.float32,)
    return False


def strip_fp32_upcast(node):
    while is_fp32_upcast(node):
        node = node.args[0]
    return node


def number(value) -> float | None:
    """A Python number literal (not a bool), as float; None for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def router_logits(logits: fx.Node):
    """Where a router's logits come from: ``linear(x, W[, b])``, optionally with fp32 upcasts of its
    inputs (``linear(x.float(), W.float())``) or of its output (``linear(x, W).float()``).

    Returns (linear node, x, W, b or None, mode) with ``mode`` the op argument saying how the logits
    are computed: "fp32_inputs" (a linear whose result is fp32), "fp32_output" (a low-precision linear,
    then an upcast) or "native" (a low-precision linear, no upcast).
    """
    linear = strip_fp32_upcast(logits)
    scaled = [op_name(strip_fp32_upcast(a)) == "linear" for a in getattr(linear, "args", ())]
    if op_name(linear) in ("mul", "truediv") and any(scaled):  # MuseSpark's output_multiplier
        by = [a.name if isinstance(a, fx.Node) else a for a, lin in zip(linear.args, scaled) if not lin]
        raise NoMatch(f"the router's logits are scaled ({op_name(linear)} by {', '.join(map(str, by))}) before "
                      "the scoring: not fused", linear)
    expect(linear, "linear")
    upcast_after = linear is not logits
    x = strip_fp32_upcast(arg(linear, 0, "input"))
    w = strip_fp32_upcast(arg(linear, 1, "weight"))
    b = arg(linear, 2, "bias")
    if b is not None:
        b = strip_fp32_upcast(b)
        if not isinstance(b, fx.Node):
            raise NoMatch(f"router linear bias is {b!r}", linear)
    if len(shape_of(x)) != 2:
        raise NoMatch(f"router input has shape {list(shape_of(x))}, expected [tokens, hidden]", linear)
    E, H = shape_of(w) if len(shape_of(w)) == 2 else (None, None)
    if H is None or not same_size(H, shape_of(x)[1]):
        raise NoMatch(f"router weight {list(shape_of(w))} does not fit hidden size {shape_of(x)[1]}", linear)
    if b is not None and shape_of(b) != (E,):
        raise NoMatch(f"router bias {list(shape_of(b))}, expected [{E}]", linear)
    if dtype_of(linear) == torch.float32:
        mode = "fp32_inputs"  # linear(x.float(), W.float()); a no-op upcast when x and W are fp32
    elif upcast_after:
        mode = "fp32_output"
    else:
        mode = "native"
    if not (dtype_of(x) == dtype_of(w) or mode == "fp32_inputs"):
        raise NoMatch(f"router linear of {dtype_of(x)} input and {dtype_of(w)} weight", linear)
    return linear, x, w, b, mode


def find_at_topk(graph: fx.Graph, pattern: str, claims, match) -> list:
    """``match`` at every top-k node ``claims`` takes: its Candidate, or a Rejection naming where it failed."""
    found = []
    for node in graph.nodes:
        if is_(node, "topk") and claims(node):
            try:
                found.append(match(node))
            except NoMatch as e:
                found.append(Rejection(pattern, e.reason, e.node or node))
    return found
