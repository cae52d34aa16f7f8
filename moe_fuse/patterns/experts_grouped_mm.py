"""transformers' ``grouped_mm`` experts (5.x), in all its spellings:

    ids, perm = sort(top_k_index.reshape(-1))
    xs = x[perm // k]                                   # gather rows, grouped by expert
    offs = cumsum(histc(ids, bins=E, min=0, max=E-1), dtype=int32)
    [mask = (ids >= E)[:, None]; ids.clamp_(max=E-1); xs.masked_fill_(mask, 0)]   # EP sentinels (5.17)
    h = grouped_mm(xs, W_gate_up.transpose(-2, -1), offs)   # _grouped_mm, F.grouped_mm or
    [h.add_(b_gate_up[ids])]                                 # transformers::grouped_mm_fallback; has_bias
    [h = h.masked_fill(mask, 0)]
    gate, up = h.chunk(2, dim=-1)                            # or h[..., ::2], h[..., 1::2] (GPT-OSS)
    [gate, up = gate.clamp(max=L), up.clamp(-L, L)]         # swiglu_limit
    act = silu(gate) * up                                    # or in fp32 and cast back; or (up + 1) * (gate * sigmoid(gate * a));
                                                             # or gelu(gate, approximate="tanh") * up
    ys = grouped_mm(act, W_down.transpose(-2, -1), offs)
    [ys.add_(b_down[ids])]
    [ys = ys.masked_fill(mask, 0)]
    out = ys * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inv = empty_like(perm); inv[perm] = arange(S)
    y = out[inv].view(T, k, H).sum(dim=1).to(x.dtype)

Experts without a gate (transformers' ``has_gate=False``, Nemotron-H) run ``h = grouped_mm(xs, W_up^T)`` and
``act = square(relu(h))`` instead of the chunk and the gated activation.

Models that store their expert weights [E, in, out] (transformers' ``is_transposed``: Aria, GPT-OSS) pass
W_gate_up and W_down to the GEMMs as they are, without the transposes; the op then reads their transposes
(views). GPT-OSS's biases go to ``ops.experts_with_biases``; its interleaved gate/up rows are part of the op's
epilogue (``spec.Epilogue``), as the activation and its constants are.

Anchored on the first grouped GEMM. The walk reads every literal and index the op assumes from the graph and
checks it against the tensor shapes: k, E, the histogram's bounds, the sort, the chunk, the arange of the
un-permutation (0 to S, step 1), the [S, 1] column of routing weights, the sentinel mask (sorted ids >= E, filled
with 0), the combine's view and sum; every in-place write in the block is one of those it read. With
``moe_fuse.verify=False`` that walk alone decides; with verification on (the default) the verifier then proves the
match on random probes.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from .. import ops
from ..spec import Epilogue, ExpertsSpec
from ..pipeline.candidate import Candidate, Pattern, Rejection
from ..pipeline.graph import (
    NoMatch,
    arange_bounds,
    arg,
    collect_region,
    dtype_of,
    expect,
    expect_literal,
    expect_shape,
    getitem_user,
    is_mutation,
    is_op,
    meta_value,
    op_name,
    same_size,
    shape_of,
    stray_writes,
    user_of,
)

NAME = "grouped_mm_experts"


_CASTS = ("to", "float", "int", "contiguous")
# Dtypes that hold every expert id exactly (histc's input: a float of few bits would merge experts).
_EXACT_ID_DTYPES = (torch.int64, torch.int32, torch.float32, torch.float64)


def _skip_casts(node):
    while is_op(node, *_CASTS):
        node = node.args[0]
    return node


def _through_casts(node, dtypes, what: str):
    """``node`` through its casts (``.to``, ``.float()``, ``.int()``, ``.contiguous()``), each to one of ``dtypes``:
    a cast to another dtype on the way (a round trip through bf16) changes the values."""
    while is_op(node, *_CASTS):
        if dtype_of(node) not in dtypes:
            wanted = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise NoMatch(f"{what} cast to {str(dtype_of(node)).removeprefix('torch.')}, expected {wanted}", node)
        node = node.args[0]
    return node


def _expert_weight(w_t: fx.Node, what: str) -> tuple[fx.Node, bool]:
    """A grouped GEMM's weight operand -> (W, stored transposed).

    ``W.transpose(-2, -1)`` of W [E, out, in] (nn.Linear's layout) -> (W, False); a 3-D parameter
    used as it is, W [E, in, out] (transformers' ``is_transposed`` experts: Aria, GPT-OSS) -> (W, True)."""
    if w_t.op in ("placeholder", "get_attr"):
        if len(shape_of(w_t)) != 3:
            raise NoMatch(f"{what} weight has shape {shape_of(w_t)}, expected [E, in, out]", w_t)
        return w_t, True
    expect(w_t, "transpose")
    dims = {arg(w_t, 1, "dim0"), arg(w_t, 2, "dim1")}
    if dims not in ({-2, -1}, {1, 2}):
        raise NoMatch(f"{what} weight transposed over dims {sorted(dims)}, expected the last two", w_t)
    w = w_t.args[0]
    if len(shape_of(w)) != 3:
        raise NoMatch(f"{what} weight has shape {shape_of(w)}, expected [E, out, in]", w_t)
    return w, False


def _mm_operands(mm: fx.Node):
    # _grouped_mm(self, mat2, offs), F.grouped_mm(mat_a, mat_b, offs=) and the
    # transformers fallback(input, weight, offs) all take the operands positionally.
    if len(mm.args) < 2:
        raise NoMatch("grouped GEMM operands passed by keyword", mm)
    a, b = mm.args[:2]
    offs = arg(mm, 2, "offs")
    if arg(mm, 3, "bias") is not None:
        raise NoMatch("grouped GEMM with a bias", mm)
    if mm.kwargs.get("out_dtype") not in (None, dtype_of(mm)):
        raise NoMatch("grouped GEMM with an out_dtype", mm)
    return a, b, offs


def _skip_bias(mm: fx.Node, sorted_ids: fx.Node, shape: tuple, what: str):
    """transformers' ``out.add_(bias[sorted ids])`` after a grouped GEMM (``has_bias``) -> (what reads the
    biased rows, the bias [E, N], the add); (mm, None, None) without one. An add into the GEMM's rows of anything
    else is no match."""
    adds = [u for u in mm.users if is_op(u, "add_", "add") and u.args and u.args[0] is mm]
    if not adds:
        return mm, None, None
    if len(adds) > 1:
        raise NoMatch(f"{what} GEMM output gets {len(adds)} adds, expected one bias", adds[1])
    add = adds[0]
    rows = add.args[1] if len(add.args) == 2 and not add.kwargs else None
    if not (is_op(rows, "getitem") and rows.args[1] is sorted_ids):
        raise NoMatch(f"{what} GEMM output gets an add that is not a bias gathered by the sorted expert ids", add)
    bias = rows.args[0]
    if bias.op not in ("placeholder", "get_attr") or shape_of(bias) != shape:
        raise NoMatch(f"{what} bias {bias.name} has shape {shape_of(bias)}, expected {list(shape)}", rows)
    return (mm if is_op(add, "add_") else add), bias, add


def _column_half(index) -> int | None:
    """0 for ``[..., ::2]`` (or ``[:, ::2]``), 1 for ``[..., 1::2]``, else None."""
    if not (isinstance(index, tuple) and len(index) == 2 and index[0] in (Ellipsis, slice(None))):
        return None
    cols = index[1]
    if isinstance(cols, slice) and cols.step == 2 and cols.stop is None and cols.start in (None, 0, 1):
        return cols.start or 0
    return None


def _gate_up_split(node: fx.Node):
    """``node.chunk(2, dim=-1)`` -> (gate, up, False); its even and odd columns (GPT-OSS's ``[..., ::2]``,
    ``[..., 1::2]``) -> (gate, up, True)."""
    halves = {}
    for u in node.users:
        half = _column_half(u.args[1]) if is_op(u, "getitem") and len(u.args) == 2 else None
        if half is not None:
            if half in halves:
                raise NoMatch(f"{node.name}'s columns are split twice the same way", u)
            halves[half] = u
    if halves:
        if set(halves) != {0, 1}:
            raise NoMatch(f"{node.name} is read in one column half only; expected its even and odd columns", node)
        return halves[0], halves[1], True
    chunk = user_of(node, "chunk")
    expect_literal(arg(chunk, 1, "chunks"), 2, "chunk count", chunk)
    expect_literal(arg(chunk, 2, "dim", 0) in (-1, 1), True, "chunk over the last dim", chunk)
    return getitem_user(chunk, 0), getitem_user(chunk, 1), False


def _sentinel_fill(fill: fx.Node, sorted_ids: fx.Node, E: int, S) -> fx.Node:
    """``rows.masked_fill(mask, 0)`` (or ``masked_fill_``) with transformers' expert-parallel sentinel mask
    ``(sorted_ids >= E).unsqueeze(-1)`` -> the mask. Another mask or fill value is no match: the op zeroes the rows
    of sentinel ids (>= E) and no others."""
    mask, value = arg(fill, 1, "mask"), arg(fill, 2, "value")
    if isinstance(value, bool) or value != 0:
        raise NoMatch(f"rows filled with {value!r} under a mask, expected 0 (the sentinel rows)", fill)
    if not is_op(mask, "unsqueeze", "view", "reshape"):
        raise NoMatch(f"rows masked by {getattr(mask, 'name', mask)}, expected (sorted ids >= {E}).unsqueeze(-1)", fill)
    expect_shape(mask, (S, 1), "the sentinel mask", fill)
    ge = expect(mask.args[0], "ge")
    if len(ge.args) != 2 or ge.args[0] is not sorted_ids or ge.args[1] != E or isinstance(ge.args[1], bool):
        found = " >= ".join(getattr(a, "name", repr(a)) for a in ge.args)
        raise NoMatch(f"sentinel mask is {found}, expected {sorted_ids.name} >= {E}", ge)
    return mask


def _id_writes(sorted_ids: fx.Node, masks, E: int) -> list[fx.Node]:
    """The in-place writes into the sorted expert ids: only transformers' ``clamp_(max=E-1)`` (expert parallelism),
    after the sentinel masks read the ids. Returns them."""
    writes = [u for u in sorted_ids.users if is_mutation(u) and u.args[0] is sorted_ids]
    for w in writes:
        if not is_op(w, "clamp_") or len(w.args) > 3:
            raise NoMatch(f"an in-place {op_name(w)} writes into the sorted expert ids, expected clamp_(max={E - 1})",
                          w)
        low, high = arg(w, 1, "min"), arg(w, 2, "max")
        if low not in (None, 0) or isinstance(low, bool) or high != E - 1 or isinstance(high, bool):
            raise NoMatch(f"sorted expert ids clamped to [{low}, {high}], expected clamp_(max={E - 1})", w)
        if any(w < mask.args[0] for mask in masks):
            raise NoMatch("the sorted expert ids are clamped before the sentinel mask reads them", w)
    return writes


def match_combine(rows: fx.Node, k: int, H: int, x: fx.Node) -> fx.Node:
    """Weighted rows in (token, slot) order -> ``rows.view(T, k, H).sum(dim=1)[.to(x.dtype)]``.

    Returns the block's output node. Shared by the experts patterns.
    """
    view = user_of(rows, "view", "reshape")
    dims = list(view.args[1:]) if len(view.args) > 2 else list(view.args[1])
    if len(dims) != 3 or dims[1] != k or dims[2] not in (H, -1):
        raise NoMatch(f"combine views rows as {dims}, expected [T, {k}, {H}]", view)
    expect_shape(view, (shape_of(x)[0], k, H), "the combine's view of the rows")
    total = user_of(view, "sum")
    if total.args[0] is not view:
        raise NoMatch("the combine sums something else than the rows viewed [T, k, H]", total)
    expect_literal(arg(total, 1, "dim"), 1, "combine sum dim", total)
    if arg(total, 2, "keepdim", False):
        raise NoMatch("combine sum keeps its dim", total)
    if dtype_of(total) != dtype_of(view):
        raise NoMatch(f"combine sums {dtype_of(view)} rows in {dtype_of(total)}", total)
    out = total
    if len(total.users) == 1 and is_op(next(iter(total.users)), "to"):
        cast = next(iter(total.users))
        if dtype_of(cast) == dtype_of(x):
            out = cast
    if dtype_of(out) != dtype_of(x):
        raise NoMatch(f"combined output is {dtype_of(out)}, hidden states are {dtype_of(x)}", out)
    return out


def match(up_mm: fx.Node) -> Candidate:
    a, w_gu_t, offs = _mm_operands(up_mm)
    w_gate_up, stored_transposed = _expert_weight(w_gu_t, "gate_up")
    E, two_i, H = shape_of(w_gate_up)
    if stored_transposed:
        E, H, two_i = shape_of(w_gate_up)

    # Routing metadata: offsets from a histogram of the sorted expert ids.
    expect(offs, "cumsum")
    expect_literal(offs.kwargs.get("dtype", arg(offs, 2, "dtype")), torch.int32, "offsets dtype", offs)
    hist = expect(arg(offs, 0, "input"), "histc")
    expect_literal(arg(hist, 1, "bins"), E, "histc bins", hist)
    expect_literal(arg(hist, 2, "min"), 0, "histc min", hist)
    expect_literal(arg(hist, 3, "max"), E - 1, "histc max", hist)
    sorted_ids = expect(_through_casts(arg(hist, 0, "input"), _EXACT_ID_DTYPES, "histc input"), "getitem")
    sort = expect(sorted_ids.args[0], "sort")
    expect_literal(sorted_ids.args[1], 0, "sorted ids index", sorted_ids)
    if arg(sort, 1, "dim", -1) not in (-1, 0) or arg(sort, 2, "descending", False):
        raise NoMatch("expert ids sorted in an unexpected way", sort)
    perm = getitem_user(sort, 1)
    flat_ids = expect(arg(sort, 0, "input"), "reshape", "view", "flatten")
    ids = flat_ids.args[0]
    if len(shape_of(ids)) != 2:
        raise NoMatch(f"expert ids {list(shape_of(ids))} are not [tokens, k]", flat_ids)
    T, k = shape_of(ids)
    S = shape_of(perm)[0]
    expect_shape(flat_ids, (S,), "the flat expert ids")

    # Gathered rows: x[perm // k], possibly masked in place for EP sentinels.
    gathered = expect(_through_casts(a, (dtype_of(up_mm),), "gathered rows"), "getitem")
    if len(gathered.args) != 2:
        raise NoMatch("rows gathered with more than one index", gathered)
    x, row_token = gathered.args
    expect(row_token, "floordiv")
    if row_token.args[0] is not perm:
        raise NoMatch("rows gathered with an index other than the sort permutation", row_token)
    expect_literal(row_token.args[1], k, "row // k divisor", row_token)
    if len(shape_of(x)) != 2 or not same_size(shape_of(x)[0], T) or shape_of(x)[1] != H:
        raise NoMatch(f"hidden states {shape_of(x)} do not fit [{T}, {H}]", gathered)

    # gate_up GEMM -> [bias] -> [mask] -> chunk(2) or even / odd columns -> silu(gate) * up -> down GEMM;
    # or, for experts without a gate, up GEMM -> [mask] -> relu(up)^2 -> down GEMM.
    biased, gate_up_bias, up_add = _skip_bias(up_mm, sorted_ids, (E, two_i), "gate_up")
    masks = [u for u in biased.users if is_op(u, "masked_fill")]
    mask = _sentinel_fill(masks[0], sorted_ids, E, S) if len(masks) == 1 else None
    h = masks[0] if mask is not None else biased
    if any(is_op(u, "relu") for u in h.users):
        if gate_up_bias is not None:
            raise NoMatch("experts without a gate with a bias on the up projection (not fused yet)", up_mm)
        glu, epilogue = match_ungated(h), Epilogue("relu2")
        I = two_i
    else:
        gate, up, interleaved = _gate_up_split(h)
        gate, up, swiglu_limit = match_swiglu_limit(gate, up)
        glu, epilogue = match_glu(gate, up, swiglu_limit=swiglu_limit, interleaved=interleaved)
        I = two_i // 2
    down_mm = glu
    while not is_op(down_mm, "grouped_mm"):
        down_mm = user_of(down_mm, "to", "grouped_mm", "contiguous")
    a2, w_d_t, offs2 = _mm_operands(down_mm)
    if _through_casts(a2, (dtype_of(down_mm),), "gated activation") is not glu:
        raise NoMatch("the down GEMM does not multiply the gated activation", down_mm)
    if offs2 is not offs:
        raise NoMatch("the two grouped GEMMs use different offsets", down_mm)
    w_down, down_transposed = _expert_weight(w_d_t, "down")
    if down_transposed != stored_transposed:
        raise NoMatch("one expert weight is stored transposed and the other is not", down_mm)
    if shape_of(w_down) != ((E, I, H) if stored_transposed else (E, H, I)):
        raise NoMatch(f"down weight {shape_of(w_down)} does not fit gate_up {shape_of(w_gate_up)}", down_mm)

    # [bias] -> weighted combine: ys * weights[perm] -> un-permute -> view(T, k, H).sum(1).
    biased_down, down_bias, down_add = _skip_bias(down_mm, sorted_ids, (E, H), "down")
    if not any(is_op(u, "masked_fill", "mul") for u in biased_down.users) and _normalized(biased_down):
        raise NoMatch("each expert's output rows are normalized before the routing weights (a norm after each "
                      "expert, transformers' has_post_expert_norm): not fused", biased_down)
    ys = user_of(biased_down, "masked_fill", "mul")
    mask2 = _sentinel_fill(ys, sorted_ids, E, S) if is_op(ys, "masked_fill") else None
    rows = ys if mask2 is not None else biased_down
    scale = user_of(rows, "mul")
    w_col = [a for a in scale.args if a is not rows]
    if len(scale.args) != 2 or scale.kwargs or len(w_col) != 1 or not is_op(w_col[0], "unsqueeze", "view", "reshape"):
        raise NoMatch("rows are not scaled by a column of routing weights", scale)
    expect_shape(w_col[0], (S, 1), "the column of routing weights", scale)
    w_rows = expect(w_col[0].args[0], "getitem")
    if w_rows.args[1] is not perm:
        raise NoMatch("routing weights gathered with an index other than the sort permutation", w_rows)
    flat_w = expect(w_rows.args[0], "reshape", "view", "flatten")
    expect_shape(flat_w, (S,), "the flat routing weights")
    weights = flat_w.args[0]
    if shape_of(weights) != shape_of(ids):
        raise NoMatch(f"routing weights {shape_of(weights)} and ids {shape_of(ids)} differ in shape", flat_w)

    unperm, unpermute = _unpermuted(scale, perm, S)
    out = match_combine(unperm, k, H, x)

    # The in-place writes the walk read: the sentinel pre-mask of the gathered rows, the ids' clamp, the biases,
    # the un-permutation. Any other write into a tensor of the block is no match (the rewrite would drop it).
    sentinel_masks = [m for m in (mask, mask2) if m is not None]
    allowed = {unpermute, up_add, down_add}
    for write in (u for u in gathered.users if is_mutation(u) and u.args[0] is gathered):
        if not is_op(write, "masked_fill_"):
            raise NoMatch(f"an in-place {op_name(write)} writes into the gathered rows, expected only the sentinel "
                          "pre-mask masked_fill_(mask, 0)", write)
        sentinel_masks.append(_sentinel_fill(write, sorted_ids, E, S))
        allowed.add(write)
    allowed.update(_id_writes(sorted_ids, sentinel_masks, E))

    spec = ExpertsSpec(
        num_experts=E,
        top_k=k,
        hidden=H,
        intermediate=I,
        dtype=dtype_of(x),
        weights_dtype=dtype_of(weights),
        expert_parallel_sentinels=mask is not None or mask2 is not None,
        epilogue=epilogue,
        layout="up_only" if not epilogue.gated else "gate_up_interleaved" if epilogue.interleaved
        else "gate_up_concat",
        gate_up_bias=gate_up_bias is not None,
        down_bias=down_bias is not None,
    )
    if gate_up_bias is not None or down_bias is not None or epilogue.interleaved or not epilogue.gated \
            or epilogue.softcaps is not None:
        _check_kernel_path(x, w_gate_up, w_down, stored_transposed, epilogue, up_mm)
    notes = ["expert weights stored [E, in, out]: the op reads transposed views (no copy)"] if stored_transposed else []
    if epilogue.interleaved:
        notes.append("gate and up are the even and odd columns of the gate_up output (the kernels read them so)")
    if gate_up_bias is not None or down_bias is not None:
        notes.append("expert biases: gate_up's added inside the SwiGLU passes, down's as a routing-weighted "
                     "[T, E] x [E, H] GEMM added to the output")
    if gate_up_bias is not None or down_bias is not None:
        cand = biased_experts_candidate(spec, (x, ids, weights, w_gate_up, w_down), gate_up_bias, down_bias, out,
                                        up_mm, notes, stored_transposed)
        stray_writes(cand.region, allowed)
        return cand
    cand = experts_candidate(NAME, spec, (x, ids, weights, w_gate_up, w_down), out, up_mm, notes,
                             stored_transposed=stored_transposed)
    stray_writes(cand.region, allowed)
    return cand


def _unpermuted(rows: fx.Node, perm: fx.Node, S) -> tuple[fx.Node, fx.Node]:
    """``rows[inv]`` with ``inv = empty_like(perm); inv[perm] = arange(S)``, the inverse of the sort permutation
    (start 0, step 1: any other arange is another permutation) -> (the un-permuted rows, the write into inv)."""
    unperm = user_of(rows, "getitem")
    if unperm.args[0] is not rows:
        raise NoMatch(f"{rows.name} is used as an index, expected rows[inv] (the un-permutation)", unperm)
    inv = expect(unperm.args[1], "empty_like")
    expect_shape(inv, (S,), "the inverse permutation")
    writes = [u for u in inv.users if is_mutation(u) and u.args[0] is inv]
    if len(writes) != 1 or not is_op(writes[0], "setitem") or writes[0].args[1] is not perm:
        raise NoMatch("the un-permutation is not inv[perm] = arange(S) (and no other write into inv)", inv)
    write = writes[0]
    rng = expect(write.args[2], "arange")
    start, end, step = arange_bounds(rng)
    if not (same_size(start, 0) and same_size(step, 1) and same_size(end, S)):  # no guards on symbolic sizes
        raise NoMatch(f"the un-permutation writes arange({start}, {end}, {step}) into inv, expected arange(0, {S}, 1)",
                      rng)
    if dtype_of(rng) not in (torch.int64, torch.int32):
        raise NoMatch(f"the un-permutation's arange is {dtype_of(rng)}, expected int64", rng)
    if not write < unperm:
        raise NoMatch("the rows are un-permuted before inv[perm] = arange(S) is written", unperm)
    return unperm, write


def _normalized(rows: fx.Node, hops: int = 10) -> bool:
    """Whether an rsqrt reads ``rows`` within a few steps (casts, a scale, pow, mean, add): an RMS norm of each row
    (MuseSpark's is eight steps from the down GEMM)."""
    frontier = {rows}
    for _ in range(hops):
        frontier = {u for n in frontier for u in n.users}
        if any(is_op(u, "rsqrt") for u in frontier):
            return True
    return False


def _check_kernel_path(x, w_gate_up, w_down, stored_transposed: bool, epilogue: Epilogue, where):
    """Expert biases, interleaved gate/up rows, experts without a gate and the softcapped SwiGLU run fused only on
    the kernels' grouped_mm path (CUDA sm90+, bf16); elsewhere on a GPU the op would run its reference, a Python loop
    over the experts slower than the graph it replaces: no match there. (On the CPU the reference is what every op
    runs.)
    Asks ``dispatch.grouped_mm_applies``, which reads only dtypes, devices and the weights' static layout (no guard
    on a symbolic token count)."""
    x_v, gu_v, d_v = (meta_value(n) for n in (x, w_gate_up, w_down))
    if not getattr(x_v, "is_cuda", False):
        return
    from ..dispatch import grouped_mm_applies

    if stored_transposed:
        gu_v, d_v = gu_v.transpose(-2, -1), d_v.transpose(-2, -1)
    if not grouped_mm_applies(x_v, gu_v, d_v):
        what = "experts without a gate" if not epilogue.gated else "the softcapped SwiGLU" \
            if epilogue.softcaps is not None else "expert biases or interleaved gate/up rows"
        raise NoMatch(f"{what} run fused on CUDA sm90+ in bf16 only (the grouped_mm path); here the op would run its "
                      "reference loop over the experts, slower than this graph", where)


def match_ungated(h: fx.Node) -> fx.Node:
    """The activation of experts without a gate (transformers' ``has_gate=False``) -> its node: transformers'
    ReLUSquaredActivation (Nemotron-H), ``square(relu(up))``, or the same as ``pow(relu(up), 2)`` or
    ``relu(up) * relu(up)``."""
    relu = user_of(h, "relu")
    if arg(relu, 1, "inplace", False):
        raise NoMatch("an in-place relu", relu)
    sq = user_of(relu, "square", "pow", "mul")
    if is_op(sq, "pow") and (len(sq.args) != 2 or sq.args[0] is not relu or sq.args[1] != 2):
        raise NoMatch(f"relu(up) raised to {sq.args[1:]}, expected the power 2 (squared ReLU)", sq)
    if is_op(sq, "mul") and list(sq.args) != [relu, relu]:
        raise NoMatch("relu(up) multiplied by something else than itself, expected relu(up)^2", sq)
    return sq


def _literal(node: fx.Node):
    """The one number among a binary op's arguments (not a bool), or None."""
    numbers = [a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    return float(numbers[0]) if len(numbers) == 1 and len(node.args) == 2 else None


def match_glu(gate: fx.Node, up: fx.Node, **gate_options) -> tuple[fx.Node, Epilogue]:
    """The gated activation after the chunk (and clamps) -> (its node, its Epilogue with ``gate_options``:
    the swiglu_limit and interleaved the walk read before): ``silu(gate) * up`` -> "silu"; the GPT-OSS-style gate
    of MiniMax-M3-VL ``(up + 1) * (gate * sigmoid(gate * a))`` -> "silu" with glu_alpha a; GeGLU (Gemma 4)
    ``gelu(gate, approximate="tanh") * up`` -> "gelu_tanh"; ``_match_softcapped``'s."""
    if any(is_op(u, "gelu") for u in gate.users):
        act = user_of(gate, "gelu")
        approximate = arg(act, 1, "approximate", "none")
        if approximate != "tanh":
            raise NoMatch(f"gelu with approximate={approximate!r}: only the tanh form is fused", act)
        glu = user_of(act, "mul")
        if set(glu.args) != {act, up}:
            raise NoMatch("gated activation is not gelu(gate, approximate='tanh') * up", glu)
        return glu, _epilogue(glu, "gelu_tanh", **gate_options)
    if not any(is_op(u, "silu") for u in gate.users) and any(is_op(u, "mul") for u in gate.users):
        scaled = [u for u in gate.users if is_op(u, "mul") and _literal(u) is not None]
        if len(scaled) != 1:
            raise NoMatch(f"{gate.name} is read by no silu and no gate * alpha", gate)
        alpha = _literal(scaled[0])
        sig = user_of(scaled[0], "sigmoid")
        act = user_of(sig, "mul")
        if set(act.args) != {gate, sig}:
            raise NoMatch("gate activation is not gate * sigmoid(gate * alpha)", act)
        plus = user_of(up, "add")
        if _literal(plus) != 1.0:
            raise NoMatch(f"up is shifted by {plus.args}, expected up + 1", plus)
        glu = user_of(act, "mul")
        if set(glu.args) != {act, plus}:
            raise NoMatch("gated activation is not (up + 1) * (gate * sigmoid(gate * alpha))", glu)
        return glu, _epilogue(glu, "silu", glu_alpha=alpha, **gate_options)
    gate, up = _through_upcast(gate), _through_upcast(up)  # Beam: silu(gate.float()) * up.float(), cast back
    if any(is_op(u, "truediv") for u in gate.users):
        return _match_softcapped(gate, up, **gate_options)
    act = user_of(gate, "silu")
    glu = user_of(act, "mul")
    if set(glu.args) != {act, up}:
        raise NoMatch("gated activation is not silu(gate) * up", glu)
    return glu, _epilogue(glu, "silu", **gate_options)


def _epilogue(node: fx.Node, activation: str, **options) -> Epilogue:
    """``Epilogue(activation, **options)``; values it refuses (a gate constant that is not finite) are no match."""
    try:
        return Epilogue(activation, **options)
    except ValueError as e:
        raise NoMatch(f"the gated activation's constants: {e}", node) from None


def _match_softcapped(gate: fx.Node, up: fx.Node, **gate_options):
    """Inkling 2's softcapped SwiGLU, ``softcap(gate, Cg) * sigmoid(gate) * softcap(up, Cu)`` ->
    (node, "softcapped_silu" with gate_cap Cg and up_cap Cu). The kernels compute it in fp32, as the model does."""
    gate_capped, gate_cap = _softcap(gate)
    sig = user_of(gate, "sigmoid")
    act = user_of(gate_capped, "mul")
    if set(act.args) != {gate_capped, sig}:
        raise NoMatch("softcapped gate is not softcap(gate) * sigmoid(gate)", act)
    up_capped, up_cap = _softcap(up)
    glu = user_of(act, "mul")
    if set(glu.args) != {act, up_capped}:
        raise NoMatch("gated activation is not softcap(gate) * sigmoid(gate) * softcap(up)", glu)
    return glu, _epilogue(glu, "softcapped_silu", gate_cap=gate_cap, up_cap=up_cap, **gate_options)


def _softcap(v: fx.Node):
    """``tanh(v / C) * C`` (transformers' softcap, C a positive number) -> (its node, C)."""
    div = user_of(v, "truediv")
    cap = _literal(div)
    if cap is None or div.args[0] is not v or div.kwargs:
        raise NoMatch(f"{v.name} divided as {div.args} {div.kwargs or ''}, expected {v.name} / C".rstrip(), div)
    if not 0 < cap < float("inf"):
        raise NoMatch(f"softcap {cap}: expected a positive finite number", div)
    tanh = user_of(div, "tanh")
    capped = user_of(tanh, "mul")
    if set(capped.args) != {tanh, cap} or len(capped.args) != 2:
        raise NoMatch(f"tanh({v.name} / {cap}) is scaled as {capped.args}, expected by {cap} (a softcap)", capped)
    return capped, cap


def _through_upcast(node: fx.Node) -> fx.Node:
    """``node.float()`` / ``node.to(torch.float32)`` when that is all that reads ``node``, else ``node``.

    SwiGLU computed in fp32 and rounded once afterwards is what the kernels compute anyway (the cast back
    to the GEMM dtype is skipped on the way to the down GEMM)."""
    if len(node.users) != 1:
        return node
    (user,) = node.users
    if is_op(user, "float") or (is_op(user, "to") and torch.float32 in (*user.args[1:], *user.kwargs.values())):
        return user
    return node


def _clamp_bounds(node: fx.Node):
    # clamp(input, min=None, max=None): method or function, positional or keyword
    return arg(node, 1, "min"), arg(node, 2, "max")


def match_swiglu_limit(gate: fx.Node, up: fx.Node):
    """transformers' ``swiglu_limit`` (DeepSeek-V4, GLM-5-Next, HY-V4, MiniMax-M3-VL): ``gate.clamp(max=L)``
    and ``up.clamp(min=-L, max=L)`` between the chunk and the gated activation (``match_glu``).

    Returns (gate, up, L) with gate and up the clamped nodes, or the inputs and None when neither half
    is clamped. Any other clamp (one half only, other bounds, a bound that is not a number) is no match.
    """
    gate_clamp = [u for u in gate.users if is_op(u, "clamp")]
    up_clamp = [u for u in up.users if is_op(u, "clamp")]
    if not gate_clamp and not up_clamp:
        return gate, up, None
    g = user_of(gate, "clamp")
    u = user_of(up, "clamp")
    g_min, g_max = _clamp_bounds(g)
    u_min, u_max = _clamp_bounds(u)
    limit = g_max
    if g_min is not None or isinstance(limit, bool) or not isinstance(limit, (int, float)):
        raise NoMatch(f"gate clamped to [{g_min}, {g_max}], expected clamp(max=L) with a number L", g)
    if not 0 < limit < float("inf"):
        raise NoMatch(f"gate clamped at max={limit}, expected a positive finite limit", g)
    if u_max != limit or u_min != -limit:
        raise NoMatch(f"up clamped to [{u_min}, {u_max}], expected [{-limit}, {limit}] (the gate's limit)", u)
    return g, u, float(limit)


def experts_from_transposed(x, ids, weights, w_gate_up, w_down, *rest):
    """``moe_fuse.experts`` of expert weights stored [E, in, out]: the op reads their transposes, views (no copy);
    their gradients come back in the stored layout (``ops.weight_layout``). Traced into the graph by the rewrite."""
    return torch.ops.moe_fuse.experts.default(x, ids, weights, w_gate_up.transpose(-2, -1), w_down.transpose(-2, -1),
                                              *rest)


def experts_with_biases(x, ids, weights, w_gate_up, w_down, gate_up_bias, down_bias, save_h, epilogue: str, *,
                        stored_transposed: bool, num_experts: int, dtype: torch.dtype):
    """``ops.experts_with_biases`` of the matched block (transposed views of weights stored [E, in, out]), with the
    shapes and dtype the match read (no Python-level checks on fx proxies). Traced into the graph by the rewrite."""
    if stored_transposed:
        w_gate_up, w_down = w_gate_up.transpose(-2, -1), w_down.transpose(-2, -1)
    y = torch.ops.moe_fuse.experts.default(x, ids, weights, w_gate_up, w_down, save_h, epilogue, gate_up_bias)[0]
    return y if down_bias is None else ops.add_down_bias(y, ids, weights, down_bias, num_experts, dtype)


def biased_experts_candidate(spec: ExpertsSpec, inputs, gate_up_bias, down_bias, out: fx.Node, anchor: fx.Node, notes,
                             stored_transposed: bool) -> Candidate:
    """``experts_candidate`` for blocks with expert biases (GPT-OSS): the biases are region inputs too, passed as
    None where absent."""
    biases = [b for b in (gate_up_bias, down_bias) if b is not None]
    save_h = torch.is_grad_enabled() and any(getattr(meta_value(n), "requires_grad", False)
                                             for n in (*inputs, *biases))
    return Candidate(
        pattern=NAME,
        spec=spec,
        region=collect_region([*inputs, *biases], [out]),
        op=functools.partial(experts_with_biases, stored_transposed=stored_transposed, num_experts=spec.num_experts,
                             dtype=spec.dtype),
        op_args=(*inputs, gate_up_bias, down_bias, save_h, spec.epilogue.encode()),
        output_index=[None],
        input_kinds=["hidden", "expert_ids", "routing_weights", "param", "param"] + ["param"] * len(biases),
        anchor=anchor,
        notes=list(notes),
        save_h_at=7,
    )


def experts_candidate(pattern: str, spec: ExpertsSpec, inputs, out: fx.Node, anchor: fx.Node, notes=(),
                      stored_transposed: bool = False) -> Candidate:
    """The region from ``inputs`` (x, ids, weights, W_gate_up, W_down) to ``out`` as one ``moe_fuse.experts`` call
    (``experts_from_transposed`` for weights stored [E, in, out]).

    The call keeps h for the backward (its sixth argument, ``save_h``) when the graph is traced for training,
    as AOTAutograd decides it: grad mode on and an input that requires grad. The spec's epilogue follows it
    unless it is the op's default (plain SwiGLU). Shared by the experts patterns.
    """
    save_h = torch.is_grad_enabled() and any(getattr(meta_value(n), "requires_grad", False) for n in inputs)
    epilogue = () if spec.epilogue == Epilogue() else (spec.epilogue.encode(),)
    return Candidate(
        pattern=pattern,
        spec=spec,
        region=collect_region(list(inputs), [out]),
        op=experts_from_transposed if stored_transposed else torch.ops.moe_fuse.experts.default,
        op_args=(*inputs, save_h, *epilogue),
        output_index=[0],
        input_kinds=["hidden", "expert_ids", "routing_weights", "param", "param"],
        anchor=anchor,
        notes=list(notes),
        save_h_at=5,
    )


def find(graph: fx.Graph) -> list[Candidate | Rejection]:
    found = []
    seen_down = set()
    for node in graph.nodes:
        if not is_op(node, "grouped_mm") or node in seen_down:
            continue
        if not node.args or not is_op(_skip_casts(node.args[0]), "getitem"):
            continue  # not fed by gathered token rows: a down projection, or no MoE at all
        try:
            cand = match(node)
            seen_down.update(n for n in cand.region.nodes if is_op(n, "grouped_mm"))
            found.append(cand)
        except NoMatch as e:
            found.append(Rejection(NAME, e.reason, e.node or node))
    return found


PATTERN = Pattern(NAME, find)
