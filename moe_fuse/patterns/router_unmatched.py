"""Router-looking top-ks that no router pattern takes: one rejection line each, naming the op that
breaks the match.

A top-k "looks like a router" when its input, a [tokens, experts] tensor, comes from a linear
through elementwise ops only (dtype casts, softmax, sigmoid, a bias, a mask, a softcap, ...). The
router patterns report the top-ks they claim themselves (matched, or rejected with their reason);
this module reports every other one, so a router that resembles nothing we know still gets a line
in report.json and ``moe_fuse.explain()``: the chain it found and where it leaves the closest
pattern. It never rewrites anything.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from . import experts_dense, router_sigmoid, router_softmax, router_topk_softmax
from ..pipeline.candidate import Pattern, Rejection
from ..pipeline.graph import NoMatch, arg, same_size, shape_of
from .router_common import is_, is_fp32_upcast, name

NAME = "unmatched_router"

# Elementwise ops a router's scores pass through between its linear and its top-k.
_WALKABLE = {
    "float", "to", "type", "type_as", "sigmoid", "softmax", "log_softmax", "logsigmoid", "tanh", "relu", "softplus",
    "exp", "add", "sub", "mul", "truediv", "masked_fill", "detach", "contiguous", "clone", "getitem",
}

# What each router pattern expects between the linear and the top-k (fp32 upcasts aside).
_OUTLINES = {
    router_softmax.NAME: (["softmax"], "top-k right after softmax"),
    router_sigmoid.NAME: (["sigmoid", "add", "masked_fill"], "sigmoid scores + a selection bias, then top-k"),
    router_topk_softmax.NAME: ([], "top-k of the logits themselves"),
}


def _shape(node):
    try:
        return tuple(shape_of(node))
    except NoMatch:
        return None


def _same(a, b) -> bool:
    """Equal shapes, symbolic sizes compared as expressions (no guards)."""
    return a is not None and b is not None and len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def _transparent(node) -> bool:
    """Ops that change nothing a router pattern cares about: fp32 upcasts, detach, contiguous, clone."""
    return is_fp32_upcast(node) or is_(node, "detach", "contiguous", "clone")


def _slice(node) -> bool:
    """``t[..., :n]``: a slice of the experts dim (a shared expert's score split off)."""
    index = node.args[1] if len(node.args) == 2 else None
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is Ellipsis or isinstance(p, slice) for p in parts)


def router_chain(topk: fx.Node):
    """(linear, [ops from the linear to the top-k input]) when the top-k ranks a linear's output over
    its last (experts) dim through elementwise ops (and slices of that dim); None otherwise."""
    node = topk.args[0] if topk.args else None
    shape = _shape(node) if isinstance(node, fx.Node) else None
    if shape is None or len(shape) < 2 or arg(topk, 2, "dim", -1) not in (-1, len(shape) - 1):
        return None
    chain = []
    for _ in range(24):
        here = _shape(node)
        if here is None or not _same(here[:-1], shape[:-1]):
            return None
        if is_(node, "linear"):
            return node, chain[::-1]
        op = name(node)
        if op not in _WALKABLE or (op != "getitem" and not _same(here, shape)):
            return None
        if op in ("to", "type") and not (len(node.args) == 2 and isinstance(node.args[1], torch.dtype)):
            return None  # .to(device) and friends: not a router's own arithmetic
        if op == "getitem" and not _slice(node):
            return None
        chain.append(node)
        if op == "getitem":
            shape = _shape(node.args[0]) if isinstance(node.args[0], fx.Node) else None
            if shape is None:
                return None
        operands = node.args[:1] if op not in ("add", "sub", "mul", "truediv") else node.args
        node = next((a for a in operands if isinstance(a, fx.Node) and _same(_shape(a), shape)), None)
        if node is None:
            return None
    return None


def _claimed(topk: fx.Node) -> bool:
    probs = topk.args[0]
    logits = router_softmax._skip_upcast(probs.args[0]) if is_(probs, "softmax") and probs.args else None
    by_softmax_router = is_(logits, "linear")
    return (by_softmax_router or router_sigmoid.claims(topk) or router_topk_softmax.claims(topk)
            or experts_dense.claims_topk(topk))


def explain_chain(topk: fx.Node, chain: list[fx.Node]) -> tuple[str, fx.Node]:
    """Why no router pattern takes this chain, and the node where it breaks."""
    ops = [n for n in chain if not _transparent(n)]
    names = [name(n) for n in ops]
    best, best_len = None, -1
    for pattern, (outline, _) in _OUTLINES.items():
        n = 0
        while n < min(len(names), len(outline)) and names[n] == outline[n]:
            n += 1
        if n > best_len:
            best, best_len = pattern, n
    path = " → ".join(["linear", *names, "topk"])
    if best_len == 0:
        wants = "; ".join(f"{p}: {what}" for p, (_, what) in _OUTLINES.items())
        node = ops[0]
        return f"router-like top-k over {path}: {name(node)} of the logits fits no router pattern ({wants})", node
    outline, what = _OUTLINES[best]
    if best_len < len(names):
        node = ops[best_len]
        return (f"router-like top-k over {path}: {best} expects {what}; {name(node)} after "
                f"{names[best_len - 1]} breaks it", node)
    return f"router-like top-k over {path}: {best} expects {what}; the top-k comes after {names[-1]}", topk


def find(graph: fx.Graph) -> list[Rejection]:
    found = []
    for node in graph.nodes:
        if not is_(node, "topk") or _claimed(node):
            continue
        walked = router_chain(node)
        if walked is None:
            continue
        _, chain = walked
        reason, where = explain_chain(node, chain)
        found.append(Rejection(NAME, reason, where))
    return found


PATTERN = Pattern(NAME, find)
