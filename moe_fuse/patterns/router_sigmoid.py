"""Sigmoid routers with a selection bias (DeepSeek-V3 and the families that copy it: GLM-4.5/4.6,
dots1, Kimi-Linear, MiMo, Solar-Open, ...; AFMoE, HY-V3, Laguna, MiniMax-M2 without groups), as
transformers 5.x writes them:

    logits = linear(x.float(), W.float())                # or linear(x, W).float()
    scores = logits.sigmoid()
    choice = scores + e_score_correction_bias             # steers the selection only
    # group-limited selection (DeepSeek-V3; with n_group = 1 the mask keeps everything):
    group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = zeros_like(group_scores); group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    choice = choice.masked_fill(~score_mask.bool(), -inf)
    ids = topk(choice, k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)                       # the unbiased scores
    weights /= weights.sum(dim=-1, keepdim=True) + 1e-20  # only if norm_topk_prob
    weights = weights * routed_scaling_factor
    [weights = weights.to(dtype)]

-> ``torch.ops.moe_fuse.router_sigmoid``. Anchored on the selecting ``topk``; every literal (the
group count and kept groups, the top-2 group score, -inf, eps, the scale, top-k's ``sorted``) is
read from the graph and checked against the shapes. The fused op runs the same ops in the same
order, so verification compares the expert ids exactly, order included.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from .. import router_ops  # noqa: F401  (registers torch.ops.moe_fuse.router_sigmoid)
from ..spec import SigmoidRouterSpec
from ..pipeline.candidate import Candidate, Pattern, Rejection
from ..pipeline.graph import NoMatch, arg, collect_region, concrete, dtype_of, getitem_user, is_mutation, shape_of
from .router_common import find_at_topk, is_, is_fp32_upcast, last_dim, name, number, router_logits, strip_fp32_upcast

NAME = "sigmoid_topk_router"


def _topk_args(topk: fx.Node, what: str):
    k = arg(topk, 1, "k")
    if not isinstance(k, int):
        raise NoMatch(f"{what} k is not a constant", topk)
    last_dim(arg(topk, 2, "dim", -1), len(shape_of(topk.args[0])), topk)
    if arg(topk, 3, "largest", True) is not True:
        raise NoMatch(f"{what} with largest=False", topk)
    sorted_ = arg(topk, 4, "sorted", True)
    if not isinstance(sorted_, bool):
        raise NoMatch(f"{what} sorted={sorted_!r}", topk)
    return k, sorted_


def _only_item(topk: fx.Node, index: int) -> fx.Node:
    """``topk(...)[index]``, the only part of the top-k that is read."""
    item = getitem_user(topk, index)
    if any(u is not item for u in topk.users):
        raise NoMatch(f"{topk.name}[{1 - index}] is read too", topk)
    return item


def _group_limit(masked: fx.Node, E: int):
    """The group mask in front of the selecting top-k.

    Returns (choice, n_group, topk_group, group_sorted, mutations)."""
    choice, mask, fill = arg(masked, 0, "input"), arg(masked, 1, "mask"), arg(masked, 2, "value")
    if not (isinstance(fill, float) and fill == -math.inf):
        raise NoMatch(f"masked_fill value {fill!r}, expected -inf", masked)
    if not is_(mask, "invert"):
        raise NoMatch(f"masked_fill mask is {name(mask) or mask}, expected ~score_mask.bool()", masked)
    mask = mask.args[0]
    if not is_(mask, "bool"):
        raise NoMatch(f"masked_fill mask is ~{name(mask)}, expected ~score_mask.bool()", masked)
    score_mask = mask.args[0]
    if not is_(score_mask, "reshape", "view") or len(shape_of(score_mask)) != 2 or shape_of(score_mask)[-1] != E:
        raise NoMatch("score mask is not a [tokens, experts] reshape of the group mask", score_mask)
    expanded = score_mask.args[0]
    if not is_(expanded, "expand") or len(shape_of(expanded)) != 3:
        raise NoMatch(f"score mask from {name(expanded)}, expected group_mask.unsqueeze(-1).expand(...)", expanded)
    _, n_group, per_group = shape_of(expanded)
    if n_group * per_group != E:
        raise NoMatch(f"{n_group} groups of {per_group} experts for {E} experts", expanded)
    unsq = expanded.args[0]
    if not (is_(unsq, "unsqueeze") and arg(unsq, 1, "dim") in (-1, 2)):
        raise NoMatch("group mask is not unsqueezed at the last dim", unsq)
    group_mask = unsq.args[0]
    if not is_(group_mask, "zeros_like"):
        raise NoMatch(f"group mask from {name(group_mask)}, expected zeros_like(group_scores)", group_mask)
    scatters = [u for u in group_mask.users if is_(u, "scatter_")]
    if len(scatters) != 1:
        raise NoMatch("group mask is not set by one scatter_", group_mask)
    scatter = scatters[0]
    dim, group_item, one = arg(scatter, 1, "dim"), arg(scatter, 2, "index"), arg(scatter, 3, "value")
    if dim not in (1, -1) or number(one) != 1.0:
        raise NoMatch(f"group mask scatter_({dim}, ..., {one!r}), expected scatter_(1, group_idx, 1)", scatter)
    if not (is_(group_item, "getitem") and group_item.args[1] == 1 and is_(group_item.args[0], "topk")):
        raise NoMatch("group mask scattered at something other than top-k group ids", scatter)
    group_topk = group_item.args[0]
    topk_group, group_sorted = _topk_args(group_topk, "group top-k")
    group_scores = group_topk.args[0]
    if arg(group_mask, 0, "input") is not group_scores:
        raise NoMatch("group mask is not zeros_like the group scores", group_mask)
    if not is_(group_scores, "sum"):
        raise NoMatch(f"group scores from {name(group_scores)}, expected a sum of the top-2 of each group",
                      group_scores)
    last_dim(arg(group_scores, 1, "dim"), 3, group_scores)
    if arg(group_scores, 2, "keepdim", False):
        raise NoMatch("group score sum keeps its dim", group_scores)
    top2 = group_scores.args[0]
    if not (is_(top2, "getitem") and top2.args[1] == 0 and is_(top2.args[0], "topk")):
        raise NoMatch("group scores are not the sum of top-k values", group_scores)
    per_group_topk = top2.args[0]
    two, _ = _topk_args(per_group_topk, "group score top-k")
    if two != 2:
        raise NoMatch(f"group score is the top-{two} sum of each group, expected top-2", per_group_topk)
    grouped = per_group_topk.args[0]
    if not (is_(grouped, "view", "reshape") and tuple(shape_of(grouped))[1:] == (n_group, per_group)):
        raise NoMatch("group top-2 is not over a [tokens, groups, experts per group] view", grouped)
    if grouped.args[0] is not choice:
        raise NoMatch("groups are ranked on other scores than the masked ones", grouped)
    if not 1 <= topk_group <= n_group:
        raise NoMatch(f"topk_group {topk_group} with {n_group} groups", group_topk)
    if per_group < 2:
        raise NoMatch(f"groups of {per_group} expert: no top-2 per group", grouped)
    return choice, n_group, topk_group, group_sorted, {scatter}


def _weights(gathered: fx.Node, ids: fx.Node):
    """gather -> [renorm] -> [* scale] -> [cast]. Returns (weights node, renorm, eps, scale, mutations)."""
    weights, renorm, eps, scale, mutations = gathered, False, 0.0, 1.0, set()
    divs = [u for u in weights.users if is_(u, "truediv", "itruediv") and u.args[0] is weights]
    if divs:
        div = divs[0]
        total = div.args[1]
        if is_(total, "add") and len(total.args) == 2 and number(total.args[1]) is not None:
            eps, total = number(total.args[1]), total.args[0]
        if not (is_(total, "sum") and arg(total, 0, "input") is weights):
            raise NoMatch("routing weights divided by something other than their sum (+ eps)", div)
        last_dim(arg(total, 1, "dim"), 2, total)
        if not (total.kwargs.get("keepdim") or total.kwargs.get("keepdims") or arg(total, 2, "keepdim", False)):
            raise NoMatch("renorm sum without keepdim", total)
        if set(weights.users) - {div, total}:
            raise NoMatch("routing weights are read elsewhere before their renorm", div)
        if is_(div, "itruediv"):
            mutations.add(div)
        weights, renorm = div, True
    if len(weights.users) == 1:
        (user,) = weights.users
        factor = None
        if is_(user, "mul") and len(user.args) == 2 and not user.kwargs:
            a, b = user.args
            factor = number(b) if a is weights else number(a) if b is weights else None
        if factor is not None:
            weights, scale = user, factor
    if len(weights.users) == 1:
        (user,) = weights.users
        if (is_(user, "to") and len(user.args) == 2 and isinstance(user.args[1], torch.dtype) and not user.kwargs) or (
            is_(user, "type_as") and len(user.args) == 2
        ):
            weights = user
    return weights, renorm, eps, scale, mutations


def match(topk: fx.Node) -> Candidate:
    top_k, sorted_ = _topk_args(topk, "top-k")
    ids = _only_item(topk, 1)
    choice = topk.args[0]
    n_group, topk_group, group_sorted, mutations = 1, 1, True, set()
    if is_(choice, "masked_fill"):
        E = shape_of(choice)[-1]
        choice, n_group, topk_group, group_sorted, mutations = _group_limit(choice, E)
    if not is_(choice, "add") or len(choice.args) != 2 or choice.kwargs:
        raise NoMatch(f"top-k of {name(choice) or choice}, expected sigmoid scores + a selection bias", topk)
    a, b = choice.args
    scores, bias = (a, b) if is_(a, "sigmoid") else (b, a)
    if not is_(scores, "sigmoid"):
        raise NoMatch("top-k of a sum without sigmoid scores", choice)
    bias = strip_fp32_upcast(bias)
    if not isinstance(bias, fx.Node):
        raise NoMatch(f"selection bias is {bias!r}, not a tensor", choice)
    logits = scores.args[0]
    if dtype_of(logits) != torch.float32:
        raise NoMatch(f"sigmoid of {dtype_of(logits)} logits, expected float32", scores)
    linear, x, w, _, mode = router_logits(logits)
    if arg(linear, 2, "bias") is not None:
        raise NoMatch("router linear has a bias", linear)
    T, H = shape_of(x)
    E = shape_of(w)[0]
    if shape_of(bias) != (E,):
        raise NoMatch(f"selection bias {list(shape_of(bias))}, expected [{E}]", choice)
    if not 1 <= top_k <= E:
        raise NoMatch(f"top-k {top_k} with {E} experts", topk)

    gathers = [u for u in scores.users if is_(u, "gather")]
    if len(gathers) != 1:
        raise NoMatch("the chosen experts' scores are not gathered once from the sigmoid scores", scores)
    gathered = gathers[0]
    if arg(gathered, 1, "dim") not in (1, -1) or arg(gathered, 2, "index") is not ids or gathered.args[0] is not scores:
        raise NoMatch("gather of the scores is not scores.gather(1, ids)", gathered)
    weights, renorm, eps, scale, more = _weights(gathered, ids)
    mutations |= more
    weights_dtype = dtype_of(weights)

    spec = SigmoidRouterSpec(
        num_experts=concrete(E), top_k=top_k, hidden=concrete(H), renorm=renorm, dtype=dtype_of(x),
        weights_dtype=weights_dtype,
        scoring="sigmoid", n_group=n_group, topk_group=topk_group, eps=eps, scale=scale, logits_mode=mode,
    )
    region = collect_region([x, w, bias], [logits, weights, ids])
    stray = [n for n in region.nodes if is_mutation(n) and n not in mutations]
    if stray:
        raise NoMatch(f"{stray[0].name} writes into a router tensor", stray[0])
    return Candidate(
        pattern=NAME,
        spec=spec,
        region=region,
        op=torch.ops.moe_fuse.router_sigmoid.default,
        op_args=(x, w, bias, top_k, n_group, topk_group, group_sorted, sorted_, renorm, eps, scale, mode,
                 weights_dtype),
        output_index=[0, 1, 2],
        input_kinds=["hidden", "param", "param"],
        anchor=topk,
        topk_outputs=None,  # same ops, same order: ids compare exactly (weights are not sorted)
    )


def claims(topk: fx.Node) -> bool:
    """A top-k of (masked) sigmoid scores + something: this pattern's, matched or reported here."""
    choice = topk.args[0] if topk.args else None
    if is_(choice, "masked_fill"):
        choice = choice.args[0]
    return is_(choice, "add") and any(is_(a, "sigmoid") for a in choice.args)


def find(graph: fx.Graph) -> list[Candidate | Rejection]:
    return find_at_topk(graph, NAME, claims, match)



PATTERN = Pattern(NAME, find)

__all__ = ["NAME", "PATTERN", "claims", "find", "match", "is_fp32_upcast"]
