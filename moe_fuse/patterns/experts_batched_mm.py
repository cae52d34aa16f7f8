"""transformers' ``batched_mm`` experts (5.x): one weight gather and one bmm per (token, slot) pair.

    xs = x.repeat_interleave(k, dim=0)                      # [S, H], S = T*k rows, token-major
    w = top_k_weights.reshape(-1); ids = top_k_index.reshape(-1)
    [mask = ids >= E; ids = ids.clamp(0, E - 1)]            # EP sentinels (5.24: clamp + mask;
                                                            #  5.17: clamp only, see below)
    h = bmm(W_gate_up[ids], xs.unsqueeze(-1)).squeeze(-1)   # [S, 2I]
    gate, up = h.chunk(2, dim=-1)
    ys = bmm(W_down[ids], (silu(gate) * up).unsqueeze(-1)).squeeze(-1)   # [S, H]
    [w = w.masked_fill(mask, 0.0)]
    y = (ys * w.unsqueeze(-1)).view(T, k, H).sum(dim=1).to(x.dtype)

Anchored on the first bmm. As in ``experts_grouped_mm``, the walk reads every literal
(k, E, the chunk, the view, the clamp bounds, the sentinel mask) from the graph and checks it
against the tensor shapes; the verifier then proves the match on random probes.

The sentinels: 5.24 clamps the ids and zeroes the routing weight of rows whose
id is >= E, which is what ``moe_fuse.experts`` does with such ids, so the
probes include them. transformers 5.17 clamps without the mask (its expert
parallel dispatch zeroes those weights upstream): on in-range ids the clamp is
the identity, so that spelling is matched as the plain block and proved on
in-range ids only.
"""

from __future__ import annotations

import torch.fx as fx

from .. import ops  # noqa: F401  (registers torch.ops.moe_fuse)
from ..spec import ExpertsSpec
from ..pipeline.candidate import Candidate, Pattern, Rejection
from .experts_grouped_mm import experts_candidate, match_combine
from ..pipeline.graph import (
    NoMatch,
    arg,
    dtype_of,
    expect,
    expect_literal,
    getitem_user,
    is_op,
    same_size,
    shape_of,
    stray_writes,
    user_of,
)

NAME = "batched_mm_experts"


def _last_dim(dim, ndim: int, what: str, node: fx.Node):
    if dim not in (-1, ndim - 1):
        raise NoMatch(f"{what} over dim {dim}, expected the last dim", node)


def _gathered_weight(node: fx.Node, what: str):
    """``W[ids]`` (W a 3-D parameter, ids a flat index) -> (W, ids)."""
    expect(node, "getitem")
    w, index = node.args
    if not isinstance(w, fx.Node) or len(shape_of(w)) != 3:
        raise NoMatch(f"{what} weights are not rows of a 3-D [E, out, in] tensor", node)
    if not isinstance(index, fx.Node) or len(shape_of(index)) != 1:
        raise NoMatch(f"{what} weights gathered with {index!r}, expected a flat tensor of expert ids", node)
    return w, index


def _bmm_operands(bmm: fx.Node, what: str):
    """``bmm(W[ids], v.unsqueeze(-1))`` -> (W, ids, v); the weights are not transposed."""
    if len(bmm.args) != 2:
        raise NoMatch(f"{what} bmm with unexpected arguments", bmm)
    w_rows, col = bmm.args
    if not is_op(w_rows, "getitem"):
        raise NoMatch(f"{what} bmm does not multiply gathered [out, in] expert weights from the left "
                      "(transposed expert weights?)", bmm)
    w, ids = _gathered_weight(w_rows, what)
    expect(col, "unsqueeze")
    _last_dim(arg(col, 1, "dim"), len(shape_of(col)), f"{what} bmm operand unsqueezed", col)
    return w, ids, col.args[0]


def _squeezed(bmm: fx.Node, what: str) -> fx.Node:
    """``bmm(...).squeeze(-1)``."""
    sq = user_of(bmm, "squeeze")
    _last_dim(arg(sq, 1, "dim"), len(shape_of(bmm)), f"{what} bmm result squeezed", sq)
    return sq


def _expert_ids(index: fx.Node, E: int):
    """The gather index -> (flat ids, clamped?). ``ids.clamp(0, E-1)`` is allowed, nothing else."""
    clamped = False
    if is_op(index, "clamp"):
        lo, hi = arg(index, 1, "min"), arg(index, 2, "max")
        if lo not in (0, None) or hi != E - 1:
            raise NoMatch(f"expert ids clamped to [{lo}, {hi}], expected [0, {E - 1}]", index)
        index, clamped = index.args[0], True
    flat = expect(index, "reshape", "view", "flatten")
    if len(flat.args) > 1 and tuple(flat.args[1:]) not in ((-1,), ((-1,),), ([-1],)):
        raise NoMatch(f"expert ids flattened as {list(flat.args[1:])}, expected (-1)", flat)
    return flat, clamped


def match(up_bmm: fx.Node) -> Candidate:
    w_gate_up, index, xs = _bmm_operands(up_bmm, "gate_up")
    E, two_i, H = shape_of(w_gate_up)
    flat_ids, clamped = _expert_ids(index, E)
    ids = flat_ids.args[0]
    if len(shape_of(ids)) != 2:
        raise NoMatch(f"expert ids {shape_of(ids)} are not [tokens, k]", flat_ids)
    T, k = shape_of(ids)

    # Token rows: x.repeat_interleave(k, dim=0), one copy per slot, token-major.
    expect(xs, "repeat_interleave")
    x = xs.args[0]
    expect_literal(arg(xs, 1, "repeats"), k, "repeat_interleave repeats", xs)
    expect_literal(arg(xs, 2, "dim"), 0, "repeat_interleave dim", xs)
    if len(shape_of(x)) != 2 or not same_size(shape_of(x)[0], T) or shape_of(x)[1] != H:
        raise NoMatch(f"hidden states {shape_of(x)} do not fit [{T}, {H}]", xs)

    # gate_up bmm -> squeeze -> chunk(2) -> silu(gate) * up -> down bmm.
    chunk = user_of(_squeezed(up_bmm, "gate_up"), "chunk")
    expect_literal(arg(chunk, 1, "chunks"), 2, "chunk count", chunk)
    _last_dim(arg(chunk, 2, "dim", 0), 2, "chunk", chunk)
    gate, up = getitem_user(chunk, 0), getitem_user(chunk, 1)
    act = user_of(gate, "silu")
    glu = user_of(act, "mul")
    if set(glu.args) != {act, up}:
        raise NoMatch("gated activation is not silu(gate) * up", glu)
    col = user_of(glu, "unsqueeze")
    down_bmm = user_of(col, "bmm")
    w_down, index2, glu_again = _bmm_operands(down_bmm, "down")
    if glu_again is not glu or down_bmm.args[1] is not col:
        raise NoMatch("the down bmm does not multiply the gated activation", down_bmm)
    if index2 is not index:
        raise NoMatch("the two weight gathers use different expert ids", down_bmm)
    if shape_of(w_down) != (E, H, two_i // 2):
        raise NoMatch(f"down weight {shape_of(w_down)} does not fit gate_up {shape_of(w_gate_up)}", down_bmm)

    # Weighted combine: ys * w.unsqueeze(-1) -> view(T, k, H).sum(1) [-> to(x.dtype)].
    scale = user_of(_squeezed(down_bmm, "down"), "mul")
    w_col = [a for a in scale.args if isinstance(a, fx.Node) and is_op(a, "unsqueeze")]
    if len(w_col) != 1 or len(scale.args) != 2:
        raise NoMatch("rows are not scaled by a column of routing weights", scale)
    _last_dim(arg(w_col[0], 1, "dim"), len(shape_of(w_col[0])), "routing weights unsqueezed", w_col[0])
    w_flat = w_col[0].args[0]
    mask = None
    if is_op(w_flat, "masked_fill"):
        mask = arg(w_flat, 1, "mask")
        expect_literal(arg(w_flat, 2, "value"), 0, "sentinel fill value", w_flat)
        ge = expect(mask, "ge")  # ids >= E, the slots of another rank's experts: the op adds nothing for those
        if len(ge.args) != 2 or ge.args[0] is not flat_ids or ge.args[1] != E or isinstance(ge.args[1], bool):
            found = " >= ".join(getattr(a, "name", repr(a)) for a in ge.args)
            raise NoMatch(f"sentinel mask is {found}, expected {flat_ids.name} >= {E}", ge)
        w_flat = w_flat.args[0]
    expect(w_flat, "reshape", "view", "flatten")
    weights = w_flat.args[0]
    if shape_of(weights) != shape_of(ids):
        raise NoMatch(f"routing weights {shape_of(weights)} and ids {shape_of(ids)} differ in shape", w_flat)

    out = match_combine(scale, k, H, x)

    spec = ExpertsSpec(
        num_experts=E,
        top_k=k,
        hidden=H,
        intermediate=two_i // 2,
        dtype=dtype_of(x),
        weights_dtype=dtype_of(weights),
        expert_parallel_sentinels=mask is not None,
    )
    notes = []
    if clamped and mask is None:
        notes.append(f"expert ids clamped to [0, {E - 1}] without a sentinel mask: proved on in-range ids")
    cand = experts_candidate(NAME, spec, (x, ids, weights, w_gate_up, w_down), out, up_bmm, notes)
    stray_writes(cand.region, ())
    return cand


def _weight_gather(bmm: fx.Node) -> fx.Node | None:
    """The ``W[ids]`` operand of a bmm, W 3-D: only such a bmm looks like batched_mm experts."""
    for operand in bmm.args[:2]:
        if is_op(operand, "getitem") and isinstance(operand.args[0], fx.Node):
            try:
                if len(shape_of(operand.args[0])) == 3 and len(shape_of(operand)) == 3:
                    return operand
            except NoMatch:
                pass
    return None


def find(graph: fx.Graph) -> list[Candidate | Rejection]:
    found = []
    seen = set()
    for node in graph.nodes:
        if not is_op(node, "bmm") or node in seen:
            continue
        gather = _weight_gather(node)
        if gather is None:
            continue
        try:
            cand = match(node)
            seen.update(n for n in cand.region.nodes if is_op(n, "bmm"))
            found.append(cand)
        except NoMatch as e:
            found.append(Rejection(NAME, e.reason, e.node or node))
            # One report per block: the block's other bmm gathers with the same ids.
            index = gather.args[1]
            if isinstance(index, fx.Node):
                seen.update(u2 for u in index.users if is_op(u, "getitem") for u2 in u.users if is_op(u2, "bmm"))
    return found


PATTERN = Pattern(NAME, find)
