"""Top-k-then-softmax routers (GPT-OSS, Granite-MoE, Aria, OpenAI privacy filter, Cohere2-MoE), as
transformers 5.x writes them:

    logits = linear(x, W, b)                       # GPT-OSS: with a bias; Granite: linear(x, W).float()
    values, ids = topk(logits, k, dim=-1)
    weights = softmax(values, dim=-1[, dtype=...])  # over the k chosen logits only
    [weights = weights / top_k]                     # OpenAI privacy filter
    [weights = weights.to(dtype) / .type_as(x)]

-> ``torch.ops.moe_fuse.router_topk_softmax`` (logits stay an output: the aux loss reads them).
Anchored on the ``topk``; the weights come out in descending order, as top-k's values do.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .. import router_ops  # noqa: F401  (registers torch.ops.moe_fuse.router_topk_softmax)
from ..spec import TopkSoftmaxRouterSpec
from . import experts_dense
from ..pipeline.candidate import Candidate, Pattern, Rejection
from ..pipeline.graph import NoMatch, arg, collect_region, concrete, dtype_of, getitem_user, is_mutation, shape_of
from .router_common import find_at_topk, is_, last_dim, name, number, router_logits, strip_fp32_upcast

NAME = "topk_softmax_router"


def match(topk: fx.Node) -> Candidate:
    logits = topk.args[0]
    k = arg(topk, 1, "k")
    if not isinstance(k, int):
        raise NoMatch("top-k is not a constant", topk)
    last_dim(arg(topk, 2, "dim", -1), len(shape_of(logits)), topk)
    if arg(topk, 3, "largest", True) is not True:
        raise NoMatch("topk(largest=False)", topk)
    if arg(topk, 4, "sorted", True) is not True:
        raise NoMatch("topk(sorted=False): the softmax weights would come in no defined order", topk)
    linear, x, w, b, mode = router_logits(logits)
    T, H = shape_of(x)
    E = shape_of(w)[0]
    if not 1 <= k <= E:
        raise NoMatch(f"top-k {k} with {E} experts", topk)

    values, ids = getitem_user(topk, 0), getitem_user(topk, 1)
    if len(values.users) != 1:
        raise NoMatch(f"top-k values are read {len(values.users)} times, expected once by softmax", values)
    (probs,) = values.users
    if not is_(probs, "softmax"):
        raise NoMatch(f"top-k values are read by {name(probs) or probs.target}, expected softmax", probs)
    last_dim(arg(probs, 1, "dim"), 2, probs)
    dtype_at = 3 if probs.target is torch.nn.functional.softmax else 2  # F.softmax(x, dim, _stacklevel, dtype)
    softmax_dtype = probs.kwargs.get("dtype", arg(probs, dtype_at, "dtype")) or dtype_of(values)
    if not isinstance(softmax_dtype, torch.dtype) or not softmax_dtype.is_floating_point:
        raise NoMatch(f"softmax dtype {softmax_dtype!r}", probs)

    weights, divisor = probs, 1.0
    if len(weights.users) == 1:
        (user,) = weights.users
        if is_(user, "truediv") and len(user.args) == 2 and user.args[0] is weights and number(user.args[1]):
            weights, divisor = user, number(user.args[1])
    if len(weights.users) == 1:
        (user,) = weights.users
        if (is_(user, "to") and len(user.args) == 2 and isinstance(user.args[1], torch.dtype) and not user.kwargs) or (
            is_(user, "type_as") and len(user.args) == 2
        ):
            weights = user
    weights_dtype = dtype_of(weights)

    spec = TopkSoftmaxRouterSpec(
        num_experts=concrete(E), top_k=k, hidden=concrete(H), renorm=False, dtype=dtype_of(x),
        weights_dtype=weights_dtype,
        scoring="topk_softmax", linear_bias=b is not None, softmax_dtype=str(softmax_dtype).removeprefix("torch."),
        divisor=divisor, logits_mode=mode,
    )
    inputs = [x, w] + ([b] if b is not None else [])
    region = collect_region(inputs, [logits, weights, ids])
    stray = [n for n in region.nodes if is_mutation(n)]
    if stray:
        raise NoMatch(f"{stray[0].name} writes into a router tensor", stray[0])
    return Candidate(
        pattern=NAME,
        spec=spec,
        region=region,
        op=torch.ops.moe_fuse.router_topk_softmax.default,
        op_args=(x, w, b, k, mode, softmax_dtype, divisor, weights_dtype),
        output_index=[0, 1, 2],
        input_kinds=["hidden", "param"] + (["param"] if b is not None else []),
        anchor=topk,
        topk_outputs=(1, 2),
    )


def claims(topk: fx.Node) -> bool:
    """A top-k of a linear's logits themselves (fp32 upcasts aside): this pattern's, matched or reported here;
    not one whose values are scattered into a score matrix (dense_experts takes that router with its experts)."""
    return bool(topk.args) and is_(strip_fp32_upcast(topk.args[0]), "linear") and not experts_dense.claims_topk(topk)


def find(graph: fx.Graph) -> list[Candidate | Rejection]:
    return find_at_topk(graph, NAME, claims, match)


PATTERN = Pattern(NAME, find)
