"""TorchTitan's expert-parallel token dispatch (``AllToAllTokenDispatcher``, torchtitan 0.3.0) in a Dynamo graph.

With ``torch._dynamo.config.capture_scalar_outputs = True`` (TorchTitan's compile sets it) the whole MoE
block is one graph:

    counts = zeros_like(scores, bool).scatter_(-1, ids, True).sum((0, 1))     # router: rows per expert
    tok = argsort(ids.view(-1), stable=True) // k;   rows = x[tok]           # _local_reorder
    counts_recv = wait(all_to_all_single(counts.view(W, -1), [1]*W, [1]*W, g)).reshape(-1)
    send_i = counts.view(W, -1).sum(1).to(cpu)[i].item()                     # the host sync (+ _assert_scalar)
    recv_i = counts_recv.view(W, -1).sum(1).to(cpu)[i].item()
    got = wait(all_to_all_single(rows, [recv_i], [send_i], g))                # dispatch
    xs = got[perm_idx]                                                        # _permute: rank-major -> expert-major
    ys = grouped GEMMs (w1, w3, w2) on xs with offs = cumsum(counts_recv.view(W, L).sum(0), int32)
    back = ys.new_empty(got.size()); back[perm_idx] = ys                     # _unpermute
    out = wait(all_to_all_single(back, [send_i], [recv_i], g))                # combine
    y = scatter_add(zeros_like(x), tok.expand(H), (out.float() * scores[perm].view(-1, 1)).to(x.dtype))

``rewrite(gm, chunks)`` replaces all of it (both row all-to-alls, the count exchange, its ``.item()`` host
syncs and their ``_assert_scalar`` checks, the permutations and the GEMMs) by one
``torch.ops.moe_fuse.ep_experts`` (``moe_fuse/parallel/ep_ops.py``): the chunked, overlapped path with its
own single count exchange.

What makes the match safe, checked literal by literal on the graph: the same process group for the three
all-to-alls; the split lists of dispatch and combine are the same ``.item()`` nodes swapped, built from
the local and exchanged counts by rank; the counts are the router's one-hot of the same top-k ids (distinct
per row, so they are the rows per expert); the rows, the routing scores and the scatter index all follow
the same argsort; k, H, W and L agree with the tensor shapes (E = W * L). ``perm_idx`` and ``offs`` are
pure functions of the exchanged counts: they are evaluated on random counts (zeros included) against the
rank-major -> expert-major permutation and the expert offsets. Nothing computed between the count
exchange and the combine may be read outside the block (else: rejected, with the reason).

Opt-in: ``torch.compile(..., backend="moe_fuse", options={"moe_fuse.ep_chunks": N})`` runs ``rewrite`` on
every graph before the other patterns (``REWRITE``, first in ``moe_fuse.patterns``); the pipeline's verifier
cannot run probes through collectives, so this match is proved by the checks above instead.
Not handled: the graph-broken form (``capture_scalar_outputs`` off: the splits become constants of a later
graph), TorchAO's padded permute, DeepEP.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .. import config
from ..pipeline.candidate import GraphRewrite
from ..pipeline.graph import NoMatch, arg, dtype_of, expect, is_mutation, is_op, meta_value, op_name, shape_of
from ..pipeline.rewrite import insert_call
from .experts_torchtitan import _expert_weight, _is_scatter_add, _mm_operands


NAME = "torchtitan_ep_dispatch"
_VIEWS = ("view", "reshape")


@dataclass
class EPMatch:
    x: fx.Node  # [T, H] tokens
    ids: fx.Node  # [T, k] expert ids
    scores: fx.Node  # [T, k] routing scores
    w1: fx.Node
    w3: fx.Node
    w2: fx.Node
    compute_dtype: torch.dtype
    group_name: str
    world: int
    output: fx.Node  # the scatter-add: y [T, H]
    remove: list[fx.Node] = field(default_factory=list)  # erased by the rewrite (graph order)


@dataclass
class EPRejection:
    reason: str
    node: fx.Node | None = None


# --------------------------------------------------------------------------- small helpers


def _c10d(node, name: str) -> bool:
    """``node`` calls ``_c10d_functional.<name>`` (packet or overload)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    target = node.target
    qualified = getattr(target, "_qualified_op_name", None) or getattr(getattr(target, "_schema", None), "name", "")
    return qualified == f"_c10d_functional::{name}"


def _method(node, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == name


def _only_user(node: fx.Node, what: str) -> fx.Node:
    if len(node.users) != 1:
        raise NoMatch(f"{node.name} ({what}) has {len(node.users)} users, expected one", node)
    return next(iter(node.users))


def _through_views(node):
    while is_op(node, *_VIEWS):
        node = node.args[0]
    return node


def _view_args(node) -> tuple:
    args = node.args[1:]
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = tuple(args[0])
    return tuple(args)


def _waited(node: fx.Node) -> fx.Node:
    """The all_to_all_single behind one or more ``wait_tensor``s."""
    while _c10d(node, "wait_tensor"):
        node = node.args[0]
    return node


def _a2a_args(a2a: fx.Node):
    if a2a.kwargs or len(a2a.args) != 4:
        raise NoMatch("all_to_all_single with unexpected arguments", a2a)
    return a2a.args


# --------------------------------------------------------------------------- the walk


def _splits(items, world: int, what: str):
    """[tensor_cpu[i].item() for i in range(W)] -> tensor_cpu (one node, read by rank in order)."""
    if not isinstance(items, (list, tuple)) or len(items) != world:
        raise NoMatch(f"{what} splits are {items!r}, expected {world} values")
    source = None
    for i, item in enumerate(items):
        if not (_method(item, "item") and is_op(item.args[0], "getitem")):
            raise NoMatch(f"{what} split {i} is not a .item() of the split tensor", item if isinstance(item, fx.Node) else None)
        tensor, index = item.args[0].args
        if index != i or (source is not None and tensor is not source):
            raise NoMatch(f"{what} split {i} reads {tensor.name}[{index}]", item)
        source = tensor
    return source


def _per_rank_sums(cpu_copy: fx.Node, world: int, what: str) -> fx.Node:
    """``counts.view(W, -1).sum(1).to(cpu)`` -> counts."""
    if not (_method(cpu_copy, "to") and isinstance(cpu_copy.args[1] if len(cpu_copy.args) > 1 else None, torch.device)):
        raise NoMatch(f"{what} splits are not a .to(device) copy of per-rank sums", cpu_copy)
    summed = expect(cpu_copy.args[0], "sum")
    if arg(summed, 1, "dim") not in (1, -1, (1,), [1]) or arg(summed, 2, "keepdim", False):
        raise NoMatch(f"{what} splits sum over dim {arg(summed, 1, 'dim')!r}, expected 1", summed)
    view = expect(summed.args[0], *_VIEWS)
    if _view_args(view)[:1] != (world,) or len(_view_args(view)) != 2:
        raise NoMatch(f"{what} counts viewed as {_view_args(view)}, expected ({world}, -1)", view)
    return view.args[0]


def _router_counts(counts: fx.Node, ids_topk: fx.Node, num_experts: int) -> None:
    """counts = zeros_like(scores, dtype=bool).scatter_(-1, ids_topk, True).sum(all but the expert dim)."""
    if not is_op(counts, "sum"):
        raise NoMatch(f"the per-expert counts ({counts.name}) are not computed from the top-k ids in this graph", counts)
    summed = counts
    onehot = summed.args[0]
    if not (_method(onehot, "scatter_") and onehot.args[2] is ids_topk and onehot.args[3] is True):
        raise NoMatch("the per-expert counts are not a one-hot scatter of the same top-k ids (not computed from them "
                      "in this graph)", counts)
    zeros = onehot.args[0]
    rank = len(shape_of(zeros))
    if onehot.args[1] not in (-1, rank - 1) or not is_op(zeros, "zeros_like") or dtype_of(zeros) != torch.bool:
        raise NoMatch("the one-hot of the ids is not a boolean scatter over the last dim of zeros", onehot)
    if shape_of(zeros)[-1] != num_experts:
        raise NoMatch(f"the one-hot has {shape_of(zeros)[-1]} experts, the sharded weights {num_experts}", zeros)
    dims = arg(summed, 1, "dim")
    dims = tuple(dims) if isinstance(dims, (tuple, list)) else (dims,)
    if tuple(d % rank for d in dims) != tuple(range(rank - 1)) or arg(summed, 2, "keepdim", False):
        raise NoMatch(f"the counts sum the one-hot over {dims}, expected every dim but the last", summed)
    # top-k ids are distinct within a row, so the one-hot sum is the number of rows per expert.
    if not (is_op(ids_topk, "getitem") and ids_topk.args[1] == 1 and is_op(ids_topk.args[0], "topk")):
        raise NoMatch("the expert ids are not the indices of a top-k (distinct per row)", ids_topk)


def _pure_slice(targets: list[fx.Node], inputs: set[fx.Node]) -> list[fx.Node]:
    """The nodes computing ``targets`` from ``inputs`` alone (graph order); NoMatch if anything else feeds them."""
    seen, stack = set(), list(targets)
    while stack:
        node = stack.pop()
        if node in seen or node in inputs:
            continue
        if node.op not in ("call_function", "call_method") or node.is_impure():
            raise NoMatch(f"{node.name} feeds the permutation but is not a pure function of the exchanged counts", node)
        if _c10d(node, "all_to_all_single") or _c10d(node, "wait_tensor"):
            raise NoMatch(f"the permutation reads the collective {node.name}", node)
        seen.add(node)
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(targets[0].graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _evaluate(nodes, env):
    def value(a):
        return fx.node.map_arg(a, lambda n: env[n])

    for node in nodes:
        args, kwargs = value(node.args), value(node.kwargs)
        if node.op == "call_method":
            env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            env[node] = node.target(*args, **kwargs)
    return env


def _check_permutation(pidx, offs, counts_recv, recv_items, world, local, device):
    """Evaluate perm_idx and offs on random exchanged counts; compare with what they must be."""
    nodes = _pure_slice([pidx, offs], {counts_recv, *recv_items})
    gen = torch.Generator().manual_seed(0)
    probes = [torch.zeros(world * local, dtype=torch.int64)] + [
        torch.randint(0, 5, (world * local,), generator=gen) for _ in range(6)
    ]
    for probe in probes:
        per_rank = probe.view(world, local).sum(1)
        env = {counts_recv: probe.to(device)}
        env.update({item: int(per_rank[i]) for i, item in enumerate(recv_items)})
        env = _evaluate(nodes, env)
        # Received rows come by (source rank, local expert); the GEMMs want (local expert, source rank).
        starts = torch.cumsum(probe, 0) - probe
        want = [starts[r * local + e].item() + i for e in range(local) for r in range(world)
                for i in range(probe[r * local + e].item())]
        want_offs = torch.cumsum(probe.view(world, local).sum(0), 0)
        got, got_offs = env[pidx], env[offs]
        if got.tolist() != want:
            raise NoMatch("the row permutation after the dispatch is not rank-major -> expert-major on probe counts", pidx)
        if got_offs.dtype != torch.int32 or got_offs.tolist() != want_offs.tolist():
            raise NoMatch("the grouped GEMM offsets are not the cumulative rows per local expert on probe counts", offs)


def match(dispatch: fx.Node) -> EPMatch:
    """Match TorchTitan's dispatch -> experts -> combine around the all_to_all_single ``dispatch``."""
    from torch.distributed.distributed_c10d import _resolve_process_group  # torch.distributed: only when asked for

    rows, recv_items, send_items, group = _a2a_args(dispatch)
    if not isinstance(group, str):
        raise NoMatch(f"all_to_all_single over {group!r}, expected a process group name", dispatch)
    world = _resolve_process_group(group).size()

    # Rows in: x[argsort(ids.view(-1)) // k].
    if not is_op(rows, "getitem"):
        raise NoMatch("the all-to-all does not send gathered token rows", dispatch)
    x, tok = rows.args
    expect(tok, "floordiv")
    perm, k = tok.args
    expect(perm, "argsort")
    if arg(perm, 1, "dim", -1) not in (-1, 0) or arg(perm, 2, "descending", False) or not perm.kwargs.get("stable"):
        raise NoMatch("the rows are not in a stable ascending argsort order", perm)
    flat = expect(perm.args[0], *_VIEWS)
    if _view_args(flat) != (-1,):
        raise NoMatch(f"argsort of ids viewed as {_view_args(flat)}, expected (-1,)", flat)
    ids = flat.args[0]
    if len(shape_of(x)) != 2 or len(shape_of(ids)) != 2:
        raise NoMatch(f"tokens {shape_of(x)} and ids {shape_of(ids)} must be [T, H] and [T, k]", dispatch)
    T, H = shape_of(x)
    if not isinstance(k, int) or shape_of(ids) != (T, k):
        raise NoMatch(f"rows gathered with argsort // {k!r}, ids are {shape_of(ids)}", tok)
    ids_topk = _through_views(ids)

    # The splits: the exchanged and the local counts, per rank, through one host copy each.
    send_cpu = _splits(send_items, world, "dispatch input")
    recv_cpu = _splits(recv_items, world, "dispatch output")
    counts = _per_rank_sums(send_cpu, world, "dispatch input")
    counts_recv = _per_rank_sums(recv_cpu, world, "dispatch output")
    exchange = _waited(expect(counts_recv, *_VIEWS).args[0])
    if not _c10d(exchange, "all_to_all_single") or _view_args(expect(counts_recv, *_VIEWS)) != (-1,):
        raise NoMatch("the output splits do not come from an all-to-all of the counts", counts_recv)
    sent_counts, out_sizes, in_sizes, exchange_group = _a2a_args(exchange)
    if exchange_group != group:
        raise NoMatch(f"the count exchange runs over group {exchange_group!r}, the rows over {group!r}", exchange)
    if not (is_op(sent_counts, *_VIEWS) and _view_args(sent_counts) == (world, -1) and sent_counts.args[0] is counts):
        raise NoMatch("the count exchange does not send counts.view(W, -1)", exchange)
    if out_sizes not in (None, [1] * world) or in_sizes not in (None, [1] * world):
        raise NoMatch(f"the count exchange splits are {in_sizes} -> {out_sizes}, expected even", exchange)
    E = shape_of(counts)[0] if len(shape_of(counts)) == 1 else None
    if E is None or E % world:
        raise NoMatch(f"counts of shape {shape_of(counts)} do not split over {world} ranks", counts)
    local = E // world
    _router_counts(counts, ids_topk, E)

    # The received rows, regrouped by local expert, through the three grouped GEMMs.
    got = _only_user(dispatch, "dispatch")
    if not _c10d(got, "wait_tensor"):
        raise NoMatch("the dispatch is not waited on directly", got)
    sizes = [u for u in got.users if _method(u, "size")]
    gathers = [u for u in got.users if is_op(u, "getitem")]
    if len(sizes) != 1 or len(gathers) != 1 or len(got.users) != 2:
        raise NoMatch("the received rows are read by more than the expert-major gather and its size", got)
    xs = gathers[0]
    index = xs.args[1]
    if not (isinstance(index, tuple) and len(index) == 2 and index[1] == slice(None)):
        raise NoMatch(f"received rows indexed by {index!r}, expected [perm, :]", xs)
    pidx = index[0]

    gemms = [u for u in xs.users if is_op(_gemm_of(u), "grouped_mm")]
    if len(gemms) != 2 or len(xs.users) != 3:  # gate, up, and the type_as of the down GEMM's output
        raise NoMatch("the received rows do not feed exactly the gate and up GEMMs", xs)
    gate_mm, up_mm = (_gemm_of(u) for u in gemms)
    if not any(is_op(u, "silu") for u in gate_mm.users):
        gate_mm, up_mm = up_mm, gate_mm
    silu = _sole(gate_mm, "silu")
    h = _sole(silu, "mul")
    if set(h.args) != {silu, up_mm} or len(up_mm.users) != 1:
        raise NoMatch("the activation is not silu(gate) * up", h)
    down_mm = _sole(h, "grouped_mm")
    a_gate, w1_t, offs = _mm_operands(gate_mm)
    a_up, w3_t, offs_up = _mm_operands(up_mm)
    a_down, w2_t, offs_down = _mm_operands(down_mm)
    if not (offs is offs_up is offs_down) or a_down is not h or _uncast(a_gate) is not xs or _uncast(a_up) is not xs:
        raise NoMatch("the three grouped GEMMs do not share the rows and the offsets", down_mm)
    compute_dtype = dtype_of(a_gate)
    if dtype_of(a_up) != compute_dtype or dtype_of(down_mm) != compute_dtype:
        raise NoMatch("the grouped GEMMs run in different dtypes", down_mm)
    w1 = _expert_weight(w1_t, compute_dtype, "gate (w1)")
    w3 = _expert_weight(w3_t, compute_dtype, "up (w3)")
    w2 = _expert_weight(w2_t, compute_dtype, "down (w2)")
    L, I, H1 = shape_of(w1)
    if L != local or H1 != H or shape_of(w3) != (L, I, H) or shape_of(w2) != (L, H, I):
        raise NoMatch(f"expert weights {shape_of(w1)}, {shape_of(w3)}, {shape_of(w2)} do not fit {local} local experts "
                      f"of hidden size {H}", down_mm)
    ys = _sole(down_mm, "type_as", "to")
    if dtype_of(ys) != dtype_of(x) or (is_op(ys, "type_as") and ys.args[1] is not xs):
        raise NoMatch(f"the expert output is cast to {dtype_of(ys)}, tokens are {dtype_of(x)}", ys)
    _check_permutation(pidx, offs, counts_recv, list(recv_items), world, local, meta_value(counts_recv).device)

    # Un-permute into a buffer shaped like the received rows; send it back with the splits swapped.
    back = [u for u in ys.users if _method(u, "new_empty")]
    writes = [u for u in ys.users if is_op(u, "setitem")]
    if len(ys.users) != 2 or len(back) != 1 or len(writes) != 1:
        raise NoMatch("the expert output is not written back through the permutation", ys)
    back, write = back[0], writes[0]
    if back.args[1:] != (sizes[0],) or back.kwargs:
        raise NoMatch("the un-permute buffer is not shaped like the received rows", back)
    if write.args[0] is not back or write.args[1] != (pidx, slice(None)) or write.args[2] is not ys:
        raise NoMatch("the un-permute does not write buffer[perm, :] = expert output", write)
    combines = [u for u in back.users if u is not write]
    if len(combines) != 1 or not _c10d(combines[0], "all_to_all_single"):
        raise NoMatch("the un-permuted rows are not sent back by one all-to-all", back)
    combine = combines[0]
    _, c_out, c_in, c_group = _a2a_args(combine)
    if c_group != group or list(c_out) != list(send_items) or list(c_in) != list(recv_items):
        raise NoMatch("the combine is not the dispatch reversed (same group, splits swapped)", combine)
    order = {n: i for i, n in enumerate(dispatch.graph.nodes)}
    if order[write] > order[combine]:
        raise NoMatch("the combine sends the buffer before the un-permute writes it", combine)
    out = _only_user(combine, "combine")
    if not _c10d(out, "wait_tensor"):
        raise NoMatch("the combine is not waited on directly", out)

    # Routing scores in fp32, scatter-added into zeros at the tokens.
    up = _only_user(out, "combined rows")
    if not (_method(up, "to") and dtype_of(up) == torch.float32):
        raise NoMatch("the combined rows are not cast to float32 before the scores", up)
    scaled = _sole(up, "mul")
    col = next((a for a in scaled.args if a is not up), None)
    if not (is_op(col, *_VIEWS) and _view_args(col) == (-1, 1)):
        raise NoMatch("the combined rows are not multiplied by a [-1, 1] column of scores", scaled)
    sorted_scores = col.args[0]
    if not (is_op(sorted_scores, "getitem") and sorted_scores.args[1] is perm):
        raise NoMatch("the scores are not gathered in the rows' argsort order", sorted_scores)
    flat_scores = expect(sorted_scores.args[0], *_VIEWS)
    scores = flat_scores.args[0]
    if _view_args(flat_scores) != (-1,) or shape_of(scores) != (T, k):
        raise NoMatch(f"scores {shape_of(scores)} flattened as {_view_args(flat_scores)}, expected [T, k] -> (-1,)", flat_scores)
    down_cast = _sole(scaled, "to")
    if dtype_of(down_cast) != dtype_of(x):
        raise NoMatch(f"the scaled rows are cast to {dtype_of(down_cast)}, tokens are {dtype_of(x)}", down_cast)
    scatter = _only_user(down_cast, "scaled rows")
    if not _is_scatter_add(scatter):
        raise NoMatch("the scaled rows are not scatter-added into the tokens", scatter)
    if is_op(scatter, "scatter_add"):
        target, dim, index, src = (scatter.args + (None,) * 4)[:4]
    else:
        (target, index, src), dim = scatter.args[:3], 0
    if dim != 0 or src is not down_cast or not is_op(target, "zeros_like") or target.args[0] is not x:
        raise NoMatch("the scatter-add is not into zeros_like(x) along the tokens", scatter)
    expand = expect(index, "expand")
    column = expect(expand.args[0], *_VIEWS)
    if column.args[0] is not tok or _view_args(column) != (-1, 1) or _view_args(expand) not in ((-1, H), (T * k, H)):
        raise NoMatch("the scatter index is not the rows' token ids expanded over H", expand)

    m = EPMatch(x=x, ids=ids, scores=scores, w1=w1, w3=w3, w2=w2, compute_dtype=compute_dtype, group_name=group,
                world=world, output=scatter)
    m.remove = _removable(m, exchange, send_cpu, write)
    return m


_ROW_CASTS = ("to", "bfloat16", "float", "half")


def _gemm_of(node):
    """A GEMM reached through at most one cast of its left operand (``xs.bfloat16()``), else ``node``."""
    if is_op(node, *_ROW_CASTS) and len(node.users) == 1:
        node = next(iter(node.users))
    return node


def _uncast(node):
    """The tensor behind at most one cast (two casts would round twice; the op casts once)."""
    return node.args[0] if is_op(node, *_ROW_CASTS) else node


def _sole(node: fx.Node, *names) -> fx.Node:
    if len(node.users) != 1 or not is_op(next(iter(node.users)), *names):
        found = ", ".join(op_name(u) or str(u.target) for u in node.users) or "none"
        raise NoMatch(f"{node.name} is read by {found}; expected only {' or '.join(names)}", node)
    return next(iter(node.users))


# Scalar bookkeeping Dynamo emits around .item(): range checks and sums of the unbacked split sizes.
_SCALAR_CHECKS = {operator.ge, operator.le, operator.gt, operator.lt, operator.eq, torch.sym_sum,
                  torch.ops.aten._assert_scalar.default}


def _removable(m: EPMatch, exchange: fx.Node, send_cpu: fx.Node, write: fx.Node) -> list[fx.Node]:
    """Everything the block computes after the counts: it all goes, or the match is rejected.

    Descendants of the count exchange and of the local split copy, up to the scatter-add. Anything among
    them that is not part of the walk (or Dynamo's scalar checks) would be a value used outside the block.
    """
    seen, stack = set(), [exchange, send_cpu]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node is not m.output:
            stack.extend(node.users)
    for node in seen:
        if node.op == "output":
            raise NoMatch(f"the graph returns {node.name}, a value inside the dispatch block", node)
        if node.op not in ("call_function", "call_method"):
            raise NoMatch(f"unexpected {node.op} node {node.name} inside the dispatch block", node)
        if is_mutation(node) and node is not write:
            target = getattr(node.args[0], "name", node.args[0]) if node.args else "?"
            raise NoMatch(f"{node.name} writes into {target} with values from the dispatch block", node)
        if node.is_impure() and node.target not in _SCALAR_CHECKS and not (
            _c10d(node, "all_to_all_single") or _c10d(node, "wait_tensor") or is_op(node, "setitem")
        ):
            raise NoMatch(f"{node.name} ({op_name(node) or node.target}) has a side effect inside the dispatch block", node)
    order = {n: i for i, n in enumerate(exchange.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def find(gm: fx.GraphModule) -> tuple[list[EPMatch], list[EPRejection]]:
    matches, rejections = [], []
    for node in gm.graph.nodes:
        if not _c10d(node, "all_to_all_single"):
            continue
        rows = node.args[0] if node.args else None
        # Only the row dispatch anchors a match (the count exchange and the combine are part of it).
        if not (is_op(rows, "getitem") and is_op(rows.args[1], "floordiv")):
            continue
        try:
            matches.append(match(node))
        except NoMatch as e:
            rejections.append(EPRejection(e.reason, e.node or node))
    if not matches and not rejections:
        # Asked for (moe_fuse.ep_chunks) but nothing here to try: say so where the graph moves tokens.
        other = next((n for n in gm.graph.nodes if _any_all_to_all(n)), None)
        if other is not None:
            rejections.append(EPRejection(
                f"{other.name}: no TorchTitan token dispatch in this graph (the all-to-all of argsort-gathered "
                "rows with its count exchange, grouped GEMMs and combine, captured together); left as it is",
                other,
            ))
    return matches, rejections


def _any_all_to_all(node) -> bool:
    """An all_to_all_single of any flavour: functional, functional with autograd (``all_to_all_single_autograd``)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    target = node.target
    qualified = getattr(target, "_qualified_op_name", None) or getattr(getattr(target, "_schema", None), "name", "")
    return isinstance(qualified, str) and qualified.endswith("::all_to_all_single")


def ep_experts_call(x, ids, scores, w1, w3, w2, *, compute_dtype: torch.dtype, group_name: str, chunks: int):
    """What a matched block becomes (traced into the graph): ``moe_fuse.ep_experts`` on the weights in the GEMMs'
    dtype, gate and up concatenated, and the scores in fp32 (the source scales in fp32)."""
    w1, w3, w2 = w1.to(compute_dtype), w3.to(compute_dtype), w2.to(compute_dtype)
    gate_up = torch.cat([w1, w3], dim=1)
    scores = scores.to(torch.float32)
    return torch.ops.moe_fuse.ep_experts.default(x, ids, scores, gate_up, w2, group_name, chunks)[0]


def rewrite(gm: fx.GraphModule, chunks: int = 2) -> tuple[int, list[EPRejection]]:
    """Replace every matched dispatch block of ``gm`` by ``moe_fuse.ep_experts``; returns (count, rejections).

    ``chunks`` is capped at the local expert count.
    """
    from ..parallel import ep_ops  # noqa: F401  (registers torch.ops.moe_fuse.ep_experts)

    matches, rejections = find(gm)
    graph = gm.graph
    for m in matches:
        local = shape_of(m.w1)[0]
        call = functools.partial(ep_experts_call, compute_dtype=m.compute_dtype, group_name=m.group_name,
                                 chunks=max(1, min(chunks, local)))
        with graph.inserting_before(m.output):
            y = insert_call(graph, call, (m.x, m.ids, m.scores, m.w1, m.w3, m.w2))
        upstream = _inputs_of(m.remove)
        m.output.replace_all_uses_with(y)
        for node in reversed(m.remove):
            graph.erase_node(node)
        _sweep(upstream)
    graph.lint()
    gm.recompile()
    return len(matches), rejections


def run(module: fx.GraphModule, report, where: str, values) -> bool:
    """``rewrite`` of one graph or HOP body with ``config.ep_chunks`` chunks, before the patterns see the grouped
    GEMMs inside the block; each rewrite and rejection reported. Off while ``config.ep_chunks`` is None."""
    if config.ep_chunks is None:
        return False
    count, rejections = rewrite(module, config.ep_chunks)
    for r in rejections:
        report.reject(NAME, r.reason, where, r.node)
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.moe_fuse.ep_experts.default:
            report.rewrite(NAME, where, node, {"chunks": node.args[-1], "group": node.args[-2]})
    return count > 0


REWRITE = GraphRewrite(NAME, run)


def _inputs_of(nodes) -> list[fx.Node]:
    """Every node ``nodes`` read, transitively, outside ``nodes`` (graph order)."""
    inside, seen = set(nodes), set()
    stack = [a for n in nodes for a in n.all_input_nodes]
    while stack:
        node = stack.pop()
        if node in seen or node in inside:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(next(iter(nodes)).graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _sweep(candidates: list[fx.Node]):
    """Erase the candidates nothing reads any more (the row gather, the argsort, the weight casts): pure ones only."""
    for node in reversed(candidates):
        if node.users or node.op not in ("call_function", "call_method") or node.is_impure() or is_mutation(node):
            continue
        node.graph.erase_node(node)
