"""Softmax top-k routers (Qwen2/3-MoE, OLMoE, Mixtral style), as transformers 5.x writes them:

    logits = linear(x, W_router)
    probs = softmax(logits, dim=-1, dtype=float32)       # Mixtral: softmax(logits.float(), dim=-1)
    values, ids = topk(probs, k, dim=-1)
    values /= values.sum(dim=-1, keepdim=True)           # only if norm_topk_prob
    weights = values.to(logits.dtype)                    # Mixtral keeps fp32 weights: no cast

Anchored on ``topk``; the logits stay an output of the fused op because the
auxiliary load-balancing loss reads them.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .. import ops  # noqa: F401  (registers torch.ops.moe_fuse)
from ..spec import RouterSpec
from ..pipeline.candidate import Candidate, Pattern, Rejection
from ..pipeline.graph import (
    NoMatch,
    arg,
    collect_region,
    dtype_of,
    expect,
    expect_literal,
    getitem_user,
    is_op,
    shape_of,
    stray_writes,
)

NAME = "softmax_topk_router"


def _last_dim(dim, ndim: int, node: fx.Node):
    if dim not in (-1, ndim - 1):
        raise NoMatch(f"reduction over dim {dim}, expected the last dim", node)


def _skip_upcast(node):
    """``logits.float()`` / ``logits.to(torch.float32)`` -> logits."""
    if is_op(node, "float") or (is_op(node, "to") and node.args[1:] == (torch.float32,) and not node.kwargs):
        return node.args[0]
    return node


def match(topk: fx.Node) -> Candidate:
    probs = arg(topk, 0, "input")
    k = arg(topk, 1, "k")
    _last_dim(arg(topk, 2, "dim", -1), len(shape_of(probs)), topk)
    if arg(topk, 3, "largest", True) is not True:
        raise NoMatch("topk(largest=False)", topk)
    if not isinstance(k, int):
        raise NoMatch("top-k is not a constant", topk)

    expect(probs, "softmax")
    logits = arg(probs, 0, "input")
    _last_dim(arg(probs, 1, "dim"), len(shape_of(logits)), probs)
    # softmax(logits, dtype=float32) (Qwen, OLMoE) or softmax(logits.float()) (Mixtral): fp32 either way. The result's
    # dtype is the one softmax computes in, however the dtype was passed (F.softmax's is argument 3, torch's 2).
    expect_literal(dtype_of(probs), torch.float32, "softmax dtype", probs)
    logits = _skip_upcast(logits)

    expect(logits, "linear")
    x, w_router = arg(logits, 0, "input"), arg(logits, 1, "weight")
    if arg(logits, 2, "bias") is not None:
        raise NoMatch("router linear has a bias", logits)
    T, H = shape_of(x) if len(shape_of(x)) == 2 else (None, None)
    if T is None:
        raise NoMatch(f"router input has shape {shape_of(x)}, expected [tokens, hidden]", logits)
    E, H_w = shape_of(w_router)
    if H_w != H:
        raise NoMatch(f"router weight {shape_of(w_router)} does not fit hidden size {H}", logits)
    if not 1 <= k <= E:
        raise NoMatch(f"top-k {k} with {E} experts", topk)

    values = getitem_user(topk, 0)
    ids = getitem_user(topk, 1)
    weights, renorm = values, False
    # Optional renormalisation: values / values.sum(-1, keepdim=True) (in place or not).
    div = [u for u in values.users if is_op(u, "itruediv", "truediv")]
    if div:
        div = div[0]
        total = div.args[1] if len(div.args) == 2 else None
        if div.args[0] is not values or not (is_op(total, "sum") and arg(total, 0, "input") is values):
            raise NoMatch("top-k values divided by something other than their sum", div)
        _last_dim(arg(total, 1, "dim"), 2, total)
        if arg(total, 2, "keepdim", False) is not True:
            raise NoMatch("renorm sum without keepdim", total)
        if dtype_of(total) != dtype_of(values):
            raise NoMatch(f"renorm sums {dtype_of(values)} top-k values in {dtype_of(total)}", total)
        others = set(values.users) - {div, total}
        if others and is_op(div, "itruediv"):
            raise NoMatch("top-k values are read elsewhere and divided in place", div)
        weights, renorm = div, True
    casts = [u for u in weights.users if is_op(u, "to")]
    if len(casts) == 1 and len(weights.users) == 1 and dtype_of(casts[0]).is_floating_point:
        weights = casts[0]
    weights_dtype = dtype_of(weights)

    spec = RouterSpec(
        num_experts=E, top_k=k, hidden=H, renorm=renorm, dtype=dtype_of(x), weights_dtype=weights_dtype
    )
    region = collect_region([x, w_router], [logits, weights, ids])
    stray_writes(region, {div} if renorm else ())  # values.mul_(2): the rewrite would drop it
    return Candidate(
        pattern=NAME,
        spec=spec,
        region=region,
        op=torch.ops.moe_fuse.router.default,
        op_args=(x, w_router, k, renorm, weights_dtype),
        output_index=[0, 1, 2],
        input_kinds=["hidden", "param"],
        anchor=topk,
        topk_outputs=(1, 2),
    )


def find(graph: fx.Graph) -> list[Candidate | Rejection]:
    found = []
    for node in graph.nodes:
        if is_op(node, "topk"):
            try:
                found.append(match(node))
            except NoMatch as e:
                # Only a top-k of softmax(linear(...)) looks like a router; anything
                # else (e.g. the load-balancing loss) is not worth a report line.
                probs = arg(node, 0, "input")
                if is_op(probs, "softmax") and is_op(_skip_upcast(arg(probs, 0, "input")), "linear"):
                    found.append(Rejection(NAME, e.reason, e.node or node))
    return found


PATTERN = Pattern(NAME, find)
