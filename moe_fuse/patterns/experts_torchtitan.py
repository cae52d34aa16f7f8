"""TorchTitan's MoE experts (``torchtitan.models.common.moe``, 0.3.0; its Qwen3, Llama4, DeepSeek-V3 MoE):
separate gate (w1), up (w3) and down (w2) weights, computed in bf16, combined with a scatter-add.

    perm = argsort(top_k_ids.view(-1), stable=True)              # LocalTokenDispatcher._local_reorder
    scores = top_k_scores.view(-1)[perm]
    tok = perm // k
    xs = x[tok]                                                  # [S, H], grouped by expert
    offs = cumsum(counts, dim=0, dtype=int32)                    # counts: one-hot scatter_ of the ids, summed
    h = silu(_grouped_mm(xs.bfloat16(), w1.bfloat16().transpose(-2, -1), offs=offs))    # GroupedExperts
    h = h * _grouped_mm(xs.bfloat16(), w3.bfloat16().transpose(-2, -1), offs=offs)
    ys = _grouped_mm(h, w2.bfloat16().transpose(-2, -1), offs=offs).type_as(xs)
    ys = (ys.to(float32) * scores.reshape(-1, 1)).to(ys.dtype)   # LocalTokenDispatcher.combine
    y = deterministic_scatter_add(zeros_like(x), tok.reshape(-1, 1).expand(-1, H), ys)   # or scatter_add

    counts = zeros_like(scores, dtype=bool).scatter_(-1, top_k_ids, True).sum(dim=(0, 1))   # MoE.forward
    counts = histc(top_k_ids.view(-1).float(), bins=E, min=0, max=E)                      # earlier TorchTitan

Anchored on the gate GEMM (the grouped GEMM whose result goes through silu). The rewrite is

    y = moe_fuse.experts(x, ids.reshape(-1, k), scores.reshape(-1, k),
                         cat([w1.to(c), w3.to(c)], dim=1), w2.to(c))      # c: the GEMMs' dtype

The op rounds like the source: it casts the gathered rows to the weights' dtype, runs both GEMMs in
it, applies the routing weight with type promotion and sums the k slots before the cast to x's
dtype. The per-expert counts are not an input of the op, which routes from the ids itself; the walk
reads them as one of the two spellings above, of the same ids (with ``moe_fuse.verify=False`` the walk
alone decides), and the verifier proves the whole block on random probes. The router (softmax or sigmoid scores, a selection bias, a gather
of the chosen scores) is left to the router patterns.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .. import ops  # noqa: F401  (registers torch.ops.moe_fuse)
from ..spec import ExpertsSpec
from ..pipeline.candidate import Candidate, Pattern, Rejection
from ..pipeline.graph import (
    NoMatch,
    arg,
    collect_region,
    dtype_of,
    expect,
    expect_literal,
    is_op,
    meta_value,
    op_name,
    same_size,
    shape_of,
    stray_writes,
    user_of,
)

NAME = "torchtitan_experts"

_CASTS = ("to", "float", "bfloat16", "half", "type_as", "contiguous")
_VIEWS = ("view", "reshape", "flatten")
# Dtypes that hold every expert id exactly (a histogram's input).
_EXACT_ID_DTYPES = (torch.int64, torch.int32, torch.float32, torch.float64)


def _skip_casts(node):
    while is_op(node, *_CASTS):
        node = node.args[0]
    return node


def _root(node):
    """Through views and reshapes to the tensor they show."""
    while is_op(node, *_VIEWS):
        node = node.args[0]
    return node


def _is_scatter_add(node) -> bool:
    """``torchtitan::deterministic_scatter_add(out, index, src)`` or ``out.scatter_add(0, index, src)``
    (not the in-place ``scatter_add_``: the region's output would then be ``out`` itself)."""
    if is_op(node, "scatter_add"):
        return True
    target = getattr(node, "target", None)
    name = getattr(target, "_qualified_op_name", None) or getattr(getattr(target, "_schema", None), "name", "")
    return node.op == "call_function" and isinstance(name, str) and name.endswith("::deterministic_scatter_add")


def _mm_operands(mm: fx.Node):
    """``_grouped_mm(A, B, offs=...)`` -> (A, B, offs); no bias, no out_dtype."""
    if len(mm.args) < 2:
        raise NoMatch("grouped GEMM operands passed by keyword", mm)
    a, b = mm.args[:2]
    if arg(mm, 3, "bias") is not None:
        raise NoMatch("grouped GEMM with a bias", mm)
    if mm.kwargs.get("out_dtype") not in (None, dtype_of(mm)):
        raise NoMatch("grouped GEMM with an out_dtype", mm)
    return a, b, arg(mm, 2, "offs")


def _expert_weight(w_t: fx.Node, compute_dtype: torch.dtype, what: str) -> fx.Node:
    """``W[.bfloat16()].transpose(-2, -1)`` -> W, a 3-D [E, out, in] tensor."""
    expect(w_t, "transpose")
    dims = {arg(w_t, 1, "dim0"), arg(w_t, 2, "dim1")}
    if dims not in ({-2, -1}, {1, 2}):
        raise NoMatch(f"{what} weight transposed over dims {sorted(dims)}, expected the last two", w_t)
    if dtype_of(w_t) != compute_dtype:
        raise NoMatch(f"{what} weight is {dtype_of(w_t)}, its GEMM runs in {compute_dtype}", w_t)
    w = _skip_casts(w_t.args[0])
    if len(shape_of(w)) != 3:
        raise NoMatch(f"{what} weight has shape {shape_of(w)}, expected [E, out, in]", w_t)
    return w


def _gathered_rows(a: fx.Node, what: str):
    """A grouped GEMM's left operand -> (x, tok): ``x[tok].bfloat16()``."""
    rows = _skip_casts(a)
    if not is_op(rows, "getitem"):
        raise NoMatch(f"the {what} GEMM does not multiply gathered token rows", a)
    return rows, rows.args[0], rows.args[1]


def _through(node: fx.Node, *names) -> fx.Node:
    """Follow ``node``'s casts to its one user among ``names``."""
    while True:
        node = user_of(node, *_CASTS, *names)
        if is_op(node, *names):
            return node


def _counts(counts: fx.Node, ids: fx.Node, E: int, k: int) -> fx.Node | None:
    """The tokens per expert, from the same ids as the rows: ``histc(ids.view(-1).float(), bins=E, min=0, max=E)``
    (or max E-1: either puts each id in [0, E) in its own bin), or the one-hot routing map
    ``zeros_like(..., dtype=bool).scatter_(-1, ids, True)`` summed over every dim but the experts'. Returns the
    scatter_ (an in-place write the block may hold), None for histc."""
    if is_op(counts, "histc"):
        flat = arg(counts, 0, "input")
        while is_op(flat, "float", "to", "int") and dtype_of(flat) in _EXACT_ID_DTYPES:
            flat = flat.args[0]
        bins, low, high = arg(counts, 1, "bins"), arg(counts, 2, "min"), arg(counts, 3, "max")
        if _root(flat) is not ids or len(shape_of(flat)) != 1:
            raise NoMatch("expert counts are a histogram of something other than the flat expert ids", counts)
        if bins != E or low != 0 or high not in (E - 1, E):
            raise NoMatch(f"expert counts histc(bins={bins}, min={low}, max={high}), expected bins={E}, min=0, "
                          f"max={E}", counts)
        return None
    if not (is_op(counts, "sum") and is_op(counts.args[0], "scatter_", "scatter")):
        raise NoMatch(f"expert counts from {op_name(counts) or counts.target}, expected a histc of the ids or the sum "
                      "of their one-hot routing map", counts)
    total, one_hot = counts, counts.args[0]
    base, dim = one_hot.args[0], arg(one_hot, 1, "dim")
    index, value = arg(one_hot, 2, "index"), arg(one_hot, 3, "value", arg(one_hot, 3, "src"))
    ndim = len(shape_of(index))
    if _root(index) is not ids or shape_of(index)[-1] != k or dim not in (-1, ndim - 1) or value not in (True, 1):
        raise NoMatch(f"expert counts from scatter_({dim}, {getattr(index, 'name', index)}, {value!r}), expected "
                      "scatter_(-1, ids, True): the one-hot routing map", one_hot)
    expect(base, "zeros", "zeros_like", "new_zeros")
    if shape_of(base) != (*shape_of(index)[:-1], E):
        raise NoMatch(f"routing map {list(shape_of(base))}, expected {[*shape_of(index)[:-1], E]}", base)
    dims = arg(total, 1, "dim")
    dims = set(dims) if isinstance(dims, (tuple, list)) else {dims}
    if {d % ndim for d in dims if isinstance(d, int)} != set(range(ndim - 1)) or len(dims) != ndim - 1 \
            or arg(total, 2, "keepdim", False):
        raise NoMatch(f"routing map summed over dims {sorted(dims, key=str)}, expected every dim but the experts'",
                      total)
    return one_hot if is_op(one_hot, "scatter_") else None


def experts_call(x, ids, weights, w_gate, w_up, w_down, top_k: int, compute_dtype: torch.dtype, save_h: bool):
    """What the region becomes (traced into the graph by the rewrite; called as is by the verifier)."""
    w_gate_up = torch.cat([w_gate.to(compute_dtype), w_up.to(compute_dtype)], dim=1)
    ids, weights = ids.reshape(-1, top_k), weights.reshape(-1, top_k)
    return torch.ops.moe_fuse.experts.default(x, ids, weights, w_gate_up, w_down.to(compute_dtype), save_h)[0]


def match(gate_mm: fx.Node) -> Candidate:
    a, w1_t, offs = _mm_operands(gate_mm)
    compute_dtype = dtype_of(a)
    gathered, x, tok = _gathered_rows(a, "gate")
    w1 = _expert_weight(w1_t, compute_dtype, "gate (w1)")
    E, inter, H = shape_of(w1)

    # Routing: tok = argsort(ids.view(-1)) // k; x[tok] are the rows, grouped by expert.
    expect(tok, "floordiv")
    perm, k = tok.args
    if not isinstance(k, int) or k < 1:
        raise NoMatch(f"rows gathered with argsort // {k!r}, expected a constant top-k", tok)
    if is_op(perm, "getitem"):  # torch.sort(ids)[1]
        expect_literal(perm.args[1], 1, "sort result index", perm)
        sort = expect(perm.args[0], "sort")
    else:
        sort = expect(perm, "argsort")
    if arg(sort, 1, "dim", -1) not in (-1, 0) or arg(sort, 2, "descending", False):
        raise NoMatch("expert ids sorted in an unexpected way", sort)
    flat_ids = expect(arg(sort, 0, "input"), *_VIEWS)
    ids = _root(flat_ids)
    if len(shape_of(flat_ids)) != 1 or shape_of(ids)[-1] != k:
        raise NoMatch(f"expert ids {shape_of(ids)} flattened to {shape_of(flat_ids)}, expected [..., {k}] to [-1]",
                      flat_ids)
    if len(shape_of(x)) != 2 or shape_of(x)[1] != H:
        raise NoMatch(f"hidden states {shape_of(x)} do not fit [tokens, {H}]", gathered)
    if not same_size(shape_of(flat_ids)[0], shape_of(x)[0] * k):
        raise NoMatch(f"{shape_of(flat_ids)[0]} routed rows for {shape_of(x)[0]} tokens and top-{k}", flat_ids)

    # Offsets: cumsum(counts, dtype=int32) of E experts (counts come from the ids: the region checks that).
    expect(offs, "cumsum")
    expect_literal(offs.kwargs.get("dtype", arg(offs, 2, "dtype")), torch.int32, "offsets dtype", offs)
    if shape_of(offs) != (E,):
        raise NoMatch(f"offsets {shape_of(offs)} for {E} experts", offs)
    if arg(offs, 1, "dim") not in (0, -1):
        raise NoMatch(f"offsets summed over dim {arg(offs, 1, 'dim')}, expected 0", offs)
    one_hot = _counts(arg(offs, 0, "input"), ids, E, k)

    # silu(x w1) * (x w3) -> down GEMM with w2.
    act = user_of(gate_mm, "silu")
    glu = user_of(act, "mul")
    up_mm = next((o for o in glu.args if o is not act), None)
    if len(glu.args) != 2 or not is_op(up_mm, "grouped_mm"):
        raise NoMatch("the gated activation is not silu(x w1) * (x w3)", glu)
    a3, w3_t, offs3 = _mm_operands(up_mm)
    if _gathered_rows(a3, "up")[0] is not gathered or dtype_of(a3) != compute_dtype or offs3 is not offs:
        raise NoMatch("the up GEMM does not multiply the gate GEMM's rows with its offsets", up_mm)
    w3 = _expert_weight(w3_t, compute_dtype, "up (w3)")
    if shape_of(w3) != (E, inter, H):
        raise NoMatch(f"up weight {shape_of(w3)} does not fit gate weight {shape_of(w1)}", up_mm)
    down_mm = _through(glu, "grouped_mm")
    a2, w2_t, offs2 = _mm_operands(down_mm)
    if _skip_casts(a2) is not glu or offs2 is not offs:
        raise NoMatch("the down GEMM does not multiply the gated activation with the same offsets", down_mm)
    w2 = _expert_weight(w2_t, compute_dtype, "down (w2)")
    if shape_of(w2) != (E, H, inter):
        raise NoMatch(f"down weight {shape_of(w2)} does not fit gate weight {shape_of(w1)}", down_mm)

    # Combine: rows * scores[perm] column -> scatter-add into zeros by token.
    scale = _through(down_mm, "mul")
    operands = [o for o in scale.args if isinstance(o, fx.Node)]
    cols = [o for o in operands if is_op(o, *_VIEWS, "unsqueeze") and len(shape_of(o)) == 2 and shape_of(o)[1] == 1]
    if len(scale.args) != 2 or len(operands) != 2 or len(cols) != 1:
        raise NoMatch("expert rows are not scaled by a column of routing scores", scale)
    col = cols[0]
    rows_out = next(o for o in operands if o is not col)
    if _skip_casts(rows_out) is not down_mm:
        raise NoMatch("the routing scores scale something other than the down GEMM's rows", scale)
    picked = expect(col.args[0], "getitem")
    if picked.args[1] is not perm:
        raise NoMatch("routing scores gathered with an index other than the sort permutation", picked)
    flat_scores = expect(picked.args[0], *_VIEWS)
    weights = _root(flat_scores)
    if len(shape_of(flat_scores)) != 1 or shape_of(weights) != shape_of(ids):
        raise NoMatch(f"routing scores {shape_of(weights)} do not fit the expert ids {shape_of(ids)}", flat_scores)

    scaled = scale
    while True:
        users = list(scaled.users)
        if len(users) != 1 or not (is_op(users[0], *_CASTS) or _is_scatter_add(users[0])):
            raise NoMatch(f"{scaled.name} is not combined by a scatter-add over tokens", scaled)
        if _is_scatter_add(users[0]):
            scatter = users[0]
            break
        scaled = users[0]
    if scatter.op == "call_function" and not is_op(scatter, "scatter_add"):
        base, index, src = scatter.args[:3]  # deterministic_scatter_add(out, index, src)
    else:
        base = scatter.args[0]
        dim = arg(scatter, 1, "dim")
        index, src = arg(scatter, 2, "index"), arg(scatter, 3, "src")
        expect_literal(dim, 0, "scatter-add dim", scatter)
    if src is not scaled:
        raise NoMatch("the scatter-add adds something other than the scaled rows", scatter)
    expect(base, "zeros_like", "zeros", "new_zeros")
    if shape_of(base) != shape_of(x) or dtype_of(base) != dtype_of(x):
        raise NoMatch(f"combined into {dtype_of(base)}{list(shape_of(base))}, hidden states are "
                      f"{dtype_of(x)}{list(shape_of(x))}", base)
    expand = expect(index, "expand")
    if _root(_skip_unsqueeze(expand.args[0])) is not tok:
        raise NoMatch("scatter-add index is not the rows' token index", expand)
    if dtype_of(scatter) != dtype_of(x):
        raise NoMatch(f"combined output is {dtype_of(scatter)}, hidden states are {dtype_of(x)}", scatter)

    spec = ExpertsSpec(
        num_experts=E,
        top_k=k,
        hidden=H,
        intermediate=inter,
        dtype=dtype_of(x),
        weights_dtype=dtype_of(weights),
        layout="w1_w3_w2",
    )
    inputs = [x, ids, weights, w1, w3, w2]
    save_h = torch.is_grad_enabled() and any(getattr(meta_value(n), "requires_grad", False) for n in inputs)
    notes = ["gate (w1) and up (w3) weights concatenated into one [E, 2I, H] operand on every call"]
    if compute_dtype != dtype_of(x) or compute_dtype != dtype_of(w1):
        notes.append(f"expert GEMMs in {str(compute_dtype).removeprefix('torch.')}, as the source casts "
                     f"({str(dtype_of(x)).removeprefix('torch.')} hidden states, "
                     f"{str(dtype_of(w1)).removeprefix('torch.')} weights)")
    region = collect_region(inputs, [scatter])
    stray_writes(region, {one_hot})  # the routing map's scatter_, and no other write
    return Candidate(
        pattern=NAME,
        spec=spec,
        region=region,
        op=experts_call,
        op_args=(*inputs, k, compute_dtype, save_h),
        output_index=[None],
        input_kinds=["hidden", "expert_ids", "routing_weights", "param", "param", "param"],
        anchor=gate_mm,
        notes=notes,
        save_h_at=8,
    )


def _skip_unsqueeze(node):
    while is_op(node, "unsqueeze"):
        node = node.args[0]
    return node


def _row_gemms(rows: fx.Node) -> list[fx.Node]:
    """The grouped GEMMs that multiply these gathered rows (through casts), in graph order."""
    found, stack = [], [rows]
    while stack:
        node = stack.pop()
        for user in node.users:
            if is_op(user, "grouped_mm") and user.args and user.args[0] is node:
                found.append(user)
            elif is_op(user, *_CASTS) and user.args[0] is node:
                stack.append(user)
    order = {n: i for i, n in enumerate(rows.graph.nodes)}
    return sorted(set(found), key=order.__getitem__)


def find(graph: fx.Graph) -> list[Candidate | Rejection]:
    found = []
    seen = set()
    for node in graph.nodes:
        if not is_op(node, "grouped_mm") or node in seen or not node.args:
            continue
        rows = _skip_casts(node.args[0])
        if not is_op(rows, "getitem"):
            continue  # not fed by gathered token rows: a down projection, or no MoE at all
        # Separate gate and up GEMMs on the same rows (transformers fuses them into one gate_up GEMM,
        # which the grouped_mm pattern handles). The gate is the one read by the activation.
        gemms = _row_gemms(rows)
        if len(gemms) != 2:
            continue
        gate = next((g for g in gemms if any(is_op(u, "silu") for u in g.users)), gemms[0])
        seen.update(gemms)
        try:
            cand = match(gate)
            seen.update(n for n in cand.region.nodes if is_op(n, "grouped_mm"))
            found.append(cand)
        except NoMatch as e:
            found.append(Rejection(NAME, e.reason, e.node or gate))
    return found


PATTERN = Pattern(NAME, find)
