"""Experts that run every token through every expert, with a score that is zero off the token's top-k
(Llama 4's ``Llama4TextMoe``, its own module in transformers 5.x):

    logits = router(x)                                         # [T, E]
    values, ids = topk(logits, k, dim=1)
    scores = full_like(logits, -inf).scatter_(1, ids, values)
    scores = sigmoid(scores.float()).to(logits.dtype)          # 0 off the top-k
    rows = x.repeat(E, 1) * scores.transpose(0, 1).reshape(-1, 1)     # [E*T, H], expert-major
    h = bmm(rows.view(E, -1, H), W_gate_up)                    # W_gate_up [E, H, 2I] (stored [in, out])
    gate, up = h.chunk(2, dim=-1)
    o = bmm(up * silu(gate), W_down)                           # W_down [E, I, H]
    y = o.view(-1, H).reshape(E, -1, H).sum(dim=0)

An expert's row of a token it was not chosen for is x * sigmoid(-inf) = 0, and a gated expert maps a
zero row to zero (no biases; act(0) * 0 = 0 for every gate the experts patterns take), with zero
gradients for its weights and for the score. So y is the sum over the k chosen experts of
expert_e(x * score), computed here on the T*k chosen rows only: E/k times fewer GEMM FLOPs (Llama 4
Scout: 16x). That is ``moe_fuse.experts`` on rows that are already scaled, one slot each, with routing
weights of one (``dense_as_routed``). Only non-finite hidden states tell the two apart (inf * 0 is
NaN in the dense form).

The router's top-k is part of the region (its scores reach the experts only through this scatter), so
the verifier probes the logits, not a [T, E] score matrix that no top-k could have made. Anchored on
the first bmm; every literal (E, k, the dims, the -inf fill, the chunk, the views) is read from the
graph and checked against the shapes.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.fx as fx

from .. import ops  # noqa: F401  (registers torch.ops.moe_fuse)
from ..spec import Epilogue, ExpertsSpec
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
    meta_value,
    same_size,
    shape_of,
    stray_writes,
    user_of,
)
from .experts_grouped_mm import match_glu, match_swiglu_limit
from .router_common import is_, is_fp32_upcast, name

NAME = "dense_experts"


def _dims(view: fx.Node) -> list:
    return list(view.args[1:]) if len(view.args) > 2 else list(view.args[1])


def _repeated_rows(rep: fx.Node, E: int) -> fx.Node:
    """``x.repeat(E, 1)`` -> x [T, H]."""
    x = rep.args[0]
    repeats = list(rep.args[1:]) if len(rep.args) > 2 else list(rep.args[1])
    if repeats != [E, 1] or len(shape_of(x)) != 2:
        raise NoMatch(f"token rows repeated {repeats}, expected x.repeat({E}, 1) of [tokens, hidden] rows", rep)
    return x


def _score_column(col: fx.Node, E: int, T) -> fx.Node:
    """``scores.transpose(0, 1).reshape(-1, 1)`` -> scores [T, E]."""
    expect(col, "reshape", "view")
    if _dims(col) != [-1, 1]:
        raise NoMatch(f"scores flattened as {_dims(col)}, expected (-1, 1)", col)
    tr = col.args[0]
    if is_op(tr, "t"):
        pass
    elif is_op(tr, "transpose"):
        if sorted((arg(tr, 1, "dim0"), arg(tr, 2, "dim1"))) != [0, 1]:
            raise NoMatch("scores transposed over other dims than (0, 1)", tr)
    else:
        raise NoMatch(f"the row scale is {tr.name}, expected scores.transpose(0, 1) (expert-major)", tr)
    scores = tr.args[0]
    shape = shape_of(scores)
    if len(shape) != 2 or shape[1] != E or not same_size(shape[0], T):
        raise NoMatch(f"scores {list(shape)} are not [tokens, {E}]", tr)
    return scores


def _topk_scores(scores: fx.Node):
    """``sigmoid(full_like(logits, -inf).scatter_(1, ids, values)[.float()])[.to(dtype)]`` with (values, ids) one
    top-k of logits -> (logits, k, sorted, upcast, topk, scatter)."""
    s = scores
    if is_(s, "to", "type_as", "type"):
        s = s.args[0]
    if not is_(s, "sigmoid"):
        raise NoMatch(f"scores from {name(s) or s.target}, expected sigmoid of scattered top-k logits", s)
    pre = s.args[0]
    upcast = is_fp32_upcast(pre)
    if upcast:
        pre = pre.args[0]
    if not is_(pre, "scatter_", "scatter"):
        raise NoMatch(f"sigmoid of {name(pre) or pre.target}, expected a scatter of top-k logits", pre)
    scatter = pre
    fill, dim = scatter.args[0], arg(scatter, 1, "dim")
    ids, values = arg(scatter, 2, "index"), arg(scatter, 3, "src")
    if dim not in (1, -1):
        raise NoMatch(f"scores scattered along dim {dim}, expected the experts dim", scatter)
    if not is_(fill, "full_like"):
        raise NoMatch(f"top-k logits scattered into {name(fill) or fill}, expected full_like(logits, -inf)", scatter)
    if arg(fill, 1, "fill_value") != -math.inf:
        raise NoMatch(f"off-top-k scores filled with {arg(fill, 1, 'fill_value')!r}, expected -inf "
                      "(sigmoid 0: those experts see zero rows)", fill)
    if not (is_(ids, "getitem") and is_(values, "getitem") and ids.args[0] is values.args[0]
            and ids.args[1] == 1 and values.args[1] == 0 and is_(ids.args[0], "topk")):
        raise NoMatch("scores are not scattered from one top-k's (values, ids)", scatter)
    topk = ids.args[0]
    logits = topk.args[0]
    if fill.args[0] is not logits:
        raise NoMatch("the -inf scores are not full_like the top-k's input", fill)
    k = arg(topk, 1, "k")
    if not isinstance(k, int):
        raise NoMatch("top-k is not a constant", topk)
    if arg(topk, 2, "dim", -1) not in (1, -1) or len(shape_of(logits)) != 2:
        raise NoMatch("top-k is not over the experts dim of [tokens, experts] logits", topk)
    if arg(topk, 3, "largest", True) is not True:
        raise NoMatch("topk(largest=False)", topk)
    sorted_ = arg(topk, 4, "sorted", True)
    if not isinstance(sorted_, bool):
        raise NoMatch(f"top-k sorted={sorted_!r}", topk)
    return logits, k, sorted_, upcast, topk, scatter


def _combined(down: fx.Node, E: int, T, H: int) -> fx.Node:
    """``o.view(-1, H).reshape(E, -1, H).sum(dim=0)``: views of the [E, T, H] rows, then the sum over experts."""
    node = down
    for _ in range(4):
        node = user_of(node, "view", "reshape", "sum")
        if is_op(node, "sum"):
            break
    else:
        raise NoMatch("the experts' rows are not summed over the experts", node)
    src = shape_of(node.args[0])
    if len(src) != 3 or src[0] != E or src[2] != H or not same_size(src[1], T):
        raise NoMatch(f"sum over {list(src)}, expected the experts' [E={E}, tokens, {H}] rows", node)
    expect_literal(arg(node, 1, "dim"), 0, "sum dim", node)
    if arg(node, 2, "keepdim", False):
        raise NoMatch("the sum over experts keeps its dim", node)
    return node


def dense_as_routed(x, logits, w_gate_up, w_down, save_h, *epilogue, top_k: int, sorted: bool, upcast: bool,
                    score_dtype: torch.dtype, row_dtype: torch.dtype, hidden: int):
    """The dense block on the T*k chosen rows: the same top-k and scores as the model's router, x * score per
    (token, slot), ``moe_fuse.experts`` with one slot per row and weights of one (exact), the k rows of a token
    summed. The weights are stored [E, in, out]: the op reads their transposes (views). epilogue: the op's string,
    absent for plain SwiGLU. Traced by the rewrite."""
    values, ids = torch.topk(logits, top_k, dim=-1, sorted=sorted)
    scores = torch.sigmoid(values.float() if upcast else values).to(score_dtype)
    rows = (x.unsqueeze(1) * scores.unsqueeze(-1)).reshape(-1, hidden)
    slots = ids.reshape(-1, 1)
    y = torch.ops.moe_fuse.experts.default(rows, slots, torch.ones_like(slots, dtype=row_dtype),
                                           w_gate_up.transpose(-2, -1), w_down.transpose(-2, -1), save_h,
                                           *epilogue)[0]
    return y.view(-1, top_k, hidden).sum(dim=1)


def match(up_bmm: fx.Node) -> Candidate:
    if len(up_bmm.args) != 2 or up_bmm.kwargs:
        raise NoMatch("bmm with unexpected arguments", up_bmm)
    view, w_gate_up = up_bmm.args
    if len(shape_of(w_gate_up)) != 3:
        raise NoMatch("gate_up bmm weight is not [E, H, 2I]", up_bmm)
    E, H, two_i = shape_of(w_gate_up)
    expect(view, "view", "reshape")
    routed = expect(view.args[0], "mul")
    if len(routed.args) != 2:
        raise NoMatch("the expert rows are not one product of rows and scores", routed)
    rep = next((a for a in routed.args if is_op(a, "repeat")), None)
    if rep is None:
        raise NoMatch("the expert rows are not x.repeat(E, 1) scaled by scores", routed)
    col = routed.args[1] if routed.args[0] is rep else routed.args[0]
    x = _repeated_rows(rep, E)
    T = shape_of(x)[0]
    if shape_of(x)[1] != H:
        raise NoMatch(f"hidden states {list(shape_of(x))} do not fit gate_up {[E, H, two_i]}", rep)
    scores = _score_column(col, E, T)
    logits, k, sorted_, upcast, topk, scatter = _topk_scores(scores)
    if not 1 <= k <= E:
        raise NoMatch(f"top-k {k} with {E} experts", topk)
    if shape_of(logits)[1] != E:
        raise NoMatch(f"logits {list(shape_of(logits))} for {E} experts", topk)
    dims = _dims(view)
    if len(dims) != 3 or dims[0] != E or dims[2] != H:
        raise NoMatch(f"expert rows viewed as {dims}, expected [{E}, -1, {H}]", view)

    chunk = user_of(up_bmm, "chunk")
    expect_literal(arg(chunk, 1, "chunks"), 2, "chunk count", chunk)
    if arg(chunk, 2, "dim", 0) not in (-1, 2):
        raise NoMatch("gate_up is not chunked over its last dim", chunk)
    gate, up, limit = match_swiglu_limit(getitem_user(chunk, 0), getitem_user(chunk, 1))
    glu, epilogue = match_glu(gate, up, swiglu_limit=limit)
    if epilogue.softcaps is not None:  # would need experts_grouped_mm's kernel path check; no model has it
        raise NoMatch("the softcapped SwiGLU in dense experts (not fused)", glu)
    down_bmm = user_of(glu, "bmm")
    if len(down_bmm.args) != 2 or down_bmm.args[0] is not glu or down_bmm.kwargs:
        raise NoMatch("the down bmm does not multiply the gated activation from the left", down_bmm)
    w_down = down_bmm.args[1]
    if shape_of(w_down) != (E, two_i // 2, H):
        raise NoMatch(f"down weight {list(shape_of(w_down))} does not fit gate_up {[E, H, two_i]}", down_bmm)
    out = _combined(down_bmm, E, T, H)

    dtype = dtype_of(routed)
    if not (dtype == dtype_of(w_gate_up) == dtype_of(w_down) == dtype_of(out)):
        raise NoMatch(f"rows {dtype}, weights {dtype_of(w_gate_up)} / {dtype_of(w_down)}, output {dtype_of(out)}: "
                      "expected one dtype", routed)

    spec = ExpertsSpec(num_experts=E, top_k=k, hidden=H, intermediate=two_i // 2, dtype=dtype,
                       weights_dtype=dtype_of(scores), epilogue=epilogue)
    inputs = [x, logits, w_gate_up, w_down]
    save_h = torch.is_grad_enabled() and any(getattr(meta_value(n), "requires_grad", False) for n in inputs)
    encoded = () if epilogue == Epilogue() else (epilogue.encode(),)  # the op's default left out
    region = collect_region(inputs, [out])
    stray_writes(region, {scatter})  # the scores' scatter_ into full_like(logits, -inf), and no other write
    return Candidate(
        pattern=NAME,
        spec=spec,
        region=region,
        op=functools.partial(dense_as_routed, top_k=k, sorted=sorted_, upcast=upcast, score_dtype=dtype_of(scores),
                             row_dtype=dtype, hidden=H),
        op_args=(*inputs, save_h, *encoded),
        output_index=[None],
        input_kinds=["hidden", "hidden", "param", "param"],
        anchor=up_bmm,
        notes=[f"every token ran through all {E} experts (scores 0 off the top-{k}); the fused op computes the "
               f"{k} chosen ones only ({E / k:g}x fewer expert FLOPs)"],
        save_h_at=4,
    )


def claims_topk(topk: fx.Node) -> bool:
    """A top-k whose values are scattered into a score matrix: this pattern's router, not a routing-weights one."""
    values = next((u for u in topk.users if is_op(u, "getitem") and u.args[1] == 0), None)
    return values is not None and any(is_op(u, "scatter_", "scatter") for u in values.users)


def _looks_dense(bmm: fx.Node) -> bool:
    """A bmm of viewed rows x.repeat(E, 1) * something: only such a bmm looks like dense experts."""
    if not bmm.args or not is_op(bmm.args[0], "view", "reshape"):
        return False
    rows = bmm.args[0].args[0]
    return is_op(rows, "mul") and any(is_op(a, "repeat") for a in rows.args)


def find(graph: fx.Graph) -> list[Candidate | Rejection]:
    found = []
    for node in graph.nodes:
        if not is_op(node, "bmm") or not _looks_dense(node):
            continue
        try:
            found.append(match(node))
        except NoMatch as e:
            found.append(Rejection(NAME, e.reason, e.node or node))
    return found


PATTERN = Pattern(NAME, find)
