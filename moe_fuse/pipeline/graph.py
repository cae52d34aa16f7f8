"""FX helpers shared by the pattern modules: op names, arguments, regions.

Dynamo graphs spell one operation many ways (``x.sum(...)``, ``torch.sum(x,
...)``, ``torch._C._nn.linear`` vs ``F.linear``). ``op_name`` maps each
spelling to one short name so the pattern modules read like the model code.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F


class NoMatch(Exception):
    """A candidate is not the pattern. ``node`` is where the walk stopped."""

    def __init__(self, reason: str, node: fx.Node | None = None):
        super().__init__(reason)
        self.reason = reason
        self.node = node


def _function_names():
    names = {
        torch._C._nn.linear: "linear",
        F.linear: "linear",
        F.softmax: "softmax",
        torch.softmax: "softmax",
        torch.topk: "topk",
        torch.sort: "sort",
        torch.argsort: "argsort",
        torch.scatter_add: "scatter_add",
        torch.zeros_like: "zeros_like",
        torch.zeros: "zeros",
        torch.histc: "histc",
        torch.cumsum: "cumsum",
        F.silu: "silu",
        F.relu: "relu",
        torch.relu: "relu",
        torch.square: "square",
        torch.pow: "pow",
        operator.pow: "pow",
        torch._C._nn.gelu: "gelu",  # = F.gelu
        torch.sigmoid: "sigmoid",
        torch.tanh: "tanh",
        torch.rsqrt: "rsqrt",
        operator.add: "add",
        torch.empty_like: "empty_like",
        torch.arange: "arange",
        torch.reshape: "reshape",
        torch.transpose: "transpose",
        torch.chunk: "chunk",
        torch.sum: "sum",
        torch.unsqueeze: "unsqueeze",
        torch.mul: "mul",
        torch.div: "truediv",
        torch.clamp: "clamp",
        torch.masked_fill: "masked_fill",
        operator.getitem: "getitem",
        operator.setitem: "setitem",
        operator.mul: "mul",
        operator.truediv: "truediv",
        operator.itruediv: "itruediv",
        operator.imul: "imul",
        operator.iadd: "iadd",
        operator.isub: "isub",
        operator.floordiv: "floordiv",
        operator.ge: "ge",
        torch.ge: "ge",
        torch._grouped_mm: "grouped_mm",
        torch.bmm: "bmm",
        torch.squeeze: "squeeze",
        torch.repeat_interleave: "repeat_interleave",
        torch.nonzero: "nonzero",
        torch.where: "where",
        torch._C._nn.one_hot: "one_hot",
        F.one_hot: "one_hot",
    }
    if hasattr(F, "grouped_mm"):
        names[F.grouped_mm] = "grouped_mm"
    return names


_FUNCTION_NAMES = _function_names()


def _is_transformers_fallback(target) -> bool:
    # torch.ops.transformers.grouped_mm_fallback (packet or overload): registered
    # by transformers only when it is imported, so matched by name.
    name = getattr(target, "_qualified_op_name", None) or getattr(target, "name", lambda: "")()
    return isinstance(name, str) and name.startswith("transformers::grouped_mm_fallback") and "backward" not in name


def op_name(node) -> str | None:
    """A short, spelling-independent name of what ``node`` computes, or None."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return None
    target = node.target
    try:
        name = _FUNCTION_NAMES.get(target)
    except TypeError:  # unhashable target
        name = None
    if name:
        return name
    if isinstance(target, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)) and _is_transformers_fallback(target):
        return "grouped_mm"
    return None


def is_op(node, *names) -> bool:
    return op_name(node) in names


def arg(node: fx.Node, index: int, name: str, default=None):
    """Argument ``index`` (positional, counting self for methods) or keyword ``name``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def expect(node, *names) -> fx.Node:
    if not is_op(node, *names):
        got = op_name(node) or (node.target if isinstance(node, fx.Node) else repr(node))
        where = node if isinstance(node, fx.Node) else None
        raise NoMatch(f"expected {' or '.join(names)}, found {got}", where)
    return node


def expect_literal(value, wanted, what: str, node: fx.Node):
    if value != wanted:
        raise NoMatch(f"{what} is {value!r}, expected {wanted!r}", node)


def user_of(node: fx.Node, *names) -> fx.Node:
    """The one user of ``node`` that is one of ``names``; other users may read it too
    (they are outside the pattern, and the rewrite keeps what they need)."""
    users = [u for u in node.users if is_op(u, *names)]
    if len(users) != 1:
        found = ", ".join(op_name(u) or str(u.target) for u in node.users) or "none"
        raise NoMatch(f"{node.name} is read by {found}; expected one {' or '.join(names)}", node)
    return users[0]


def getitem_user(node: fx.Node, index: int) -> fx.Node:
    """The ``node[index]`` user of a tuple-valued node."""
    for user in node.users:
        if is_op(user, "getitem") and user.args[1] == index:
            return user
    raise NoMatch(f"{node.name}[{index}] is never read", node)


def meta_value(node):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def shape_of(node) -> tuple:
    value = meta_value(node)
    if not isinstance(value, torch.Tensor):
        raise NoMatch(f"{getattr(node, 'name', node)} has no tensor metadata", node if isinstance(node, fx.Node) else None)
    return tuple(value.shape)


def dtype_of(node) -> torch.dtype:
    value = meta_value(node)
    if not isinstance(value, torch.Tensor):
        raise NoMatch(f"{getattr(node, 'name', node)} has no tensor metadata", node if isinstance(node, fx.Node) else None)
    return value.dtype


def same_size(a, b) -> bool:
    """Equal sizes, symbolic ones included (compared as expressions, not guarded)."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return str(a) == str(b)
    return a == b


def _fits(a, b) -> bool:
    """Equal sizes for ``expect_shape``: as ``same_size``, or two symbols Dynamo keeps apart (the tokens an
    expert-parallel exchange delivers, the weights beside them) with equal hints: the op then checks at run time
    that ids and weights agree ([T, k]) and raises where they do not."""
    symbolic = isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt)
    return same_size(a, b) or symbolic and concrete(a) == concrete(b)


def expect_shape(node, wanted, what: str, where: fx.Node | None = None):
    """``node``'s shape is ``wanted`` (sizes compared as ``_fits``): a broadcast along the wrong axis of a
    matching size (``w.unsqueeze(0)`` where ``w.unsqueeze(-1)`` is meant) gives another shape."""
    got = shape_of(node)
    if len(got) != len(wanted) or not all(_fits(a, b) for a, b in zip(got, wanted)):
        raise NoMatch(f"{what} has shape {list(got)}, expected {list(wanted)}", where or node)


def arange_bounds(node: fx.Node) -> tuple:
    """(start, end, step) of ``torch.arange(end)`` / ``arange(start, end[, step])``, keywords too; a size that is
    a graph value (``perm.size(0)`` under dynamic shapes) as its example value."""
    args = list(node.args)
    if len(args) == 1:  # arange(end)
        args = [0, args[0]]
    defaults = [0, None, 1]
    bounds = args + defaults[len(args):]
    for i, name in enumerate(("start", "end", "step")):
        bounds[i] = node.kwargs.get(name, bounds[i])
    return tuple(meta_value(b) if isinstance(b, fx.Node) else b for b in bounds)


def stray_writes(region: Region, allowed) -> None:
    """Raises NoMatch at the first in-place write of ``region`` that the walk did not read as part of the pattern
    (``collect_region`` pulls every write into a block tensor into the region: the rewrite would drop it)."""
    for node in region.nodes:
        if is_mutation(node) and node not in allowed:
            target = node.args[0].name if node.args and isinstance(node.args[0], fx.Node) else "?"
            raise NoMatch(f"an in-place {op_name(node) or node.target} writes into {target}, a tensor of the block: "
                          "not part of the pattern (the rewrite would drop it)", node)


def concrete(size) -> int:
    """A concrete integer for a size: the hint of a symbolic one."""
    if isinstance(size, torch.SymInt):
        return int(size.node.hint)
    return int(size)


# --------------------------------------------------------------------------- regions

# Ops that write into their first argument: a region that holds the written
# tensor must hold the write too (``inv[perm] = arange``, ``ids.clamp_()``).
_MUTATING = {"setitem", "itruediv", "imul", "iadd", "isub", "clamp_", "masked_fill_", "copy_", "mul_", "div_", "add_",
             "fill_", "zero_"}


def is_mutation(node: fx.Node) -> bool:
    name = op_name(node)
    if name in _MUTATING or (node.op == "call_method" and isinstance(node.target, str) and node.target.endswith("_")):
        return True
    target = node.target if node.op == "call_function" else None
    if isinstance(target, torch._ops.OpOverload):  # an aten-level op: its schema says whether it writes
        first = target._schema.arguments[:1]
        return bool(first) and first[0].alias_info is not None and first[0].alias_info.is_write
    name = getattr(target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


@dataclass
class Region:
    """The nodes that compute ``outputs`` from ``inputs`` (in graph order)."""

    inputs: list[fx.Node]
    outputs: list[fx.Node]
    nodes: list[fx.Node]
    # Values the region reads that are not tensors (symbolic sizes), and tensors it reads only for
    # their shape and dtype (the argument of ``zeros_like``): free inputs.
    free: list[fx.Node] = field(default_factory=list)


def _is_size_value(node: fx.Node) -> bool:
    value = meta_value(node)
    return isinstance(value, (int, torch.SymInt)) or (
        isinstance(value, (tuple, list)) and all(isinstance(v, (int, torch.SymInt)) for v in value)
    )


# Ops whose result may share memory with their input: writing into it writes into the input too.
_VIEWS = {"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "transpose", "permute", "movedim", "t",
          "expand", "expand_as", "view_as", "as_strided", "narrow", "select", "diagonal", "unfold", "getitem",
          "contiguous", "detach", "to", "type_as", "float", "double", "half", "bfloat16"}
# Multi-output ops whose outputs are views of their input.
_SPLITS = {"chunk", "split", "split_with_sizes", "unbind", "tensor_split"}


def _is_collective(node: fx.Node) -> bool:
    target = node.target if node.op == "call_function" else None
    name = getattr(target, "_qualified_op_name", None) or getattr(getattr(target, "_schema", None), "name", "")
    return isinstance(name, str) and name.startswith(("_c10d_functional", "c10d::"))


def _alias_source(node: fx.Node) -> fx.Node | None:
    """The tensor whose memory ``node``'s result may share (a view of it, or itself: ``.to`` to its own
    dtype), or None. An op this module does not know counts as a view of its first argument."""
    if is_op(node, "getitem") and isinstance(meta_value(node.args[0]), (tuple, list)):
        producer = node.args[0]  # an element of a multi-output op: topk's indices are their own tensor
        source = producer.args[0] if is_op(producer, *_SPLITS) and producer.args else None
    elif is_op(node, *_VIEWS) or op_name(node) is None:
        source = node.args[0] if node.args else None
    else:
        source = None
    return source if isinstance(source, fx.Node) else None


# Factories that read only the shape, dtype and device of their first argument.
_SHAPE_ONLY = {"zeros_like", "empty_like", "ones_like"}


def collect_region(inputs: list[fx.Node], outputs: list[fx.Node]) -> Region:
    """All nodes between ``inputs`` and ``outputs``, and the in-place writes into them placed before the
    last output (a later write into an output stays outside it; any other later write refuses).

    The argument of a ``zeros_like``-style factory that the region does not compute otherwise is a
    free input (its values are never read). Raises NoMatch when the outputs depend on a tensor that
    is not an input.
    """
    inside: set[fx.Node] = set()
    free: set[fx.Node] = set()
    shape_only: set[fx.Node] = set()
    stop = set(inputs)

    def visit(start: fx.Node):
        stack = [start]
        while stack:
            node = stack.pop()
            if node in inside or node in stop or node in free:
                continue
            if node.op in ("placeholder", "get_attr"):
                if _is_size_value(node):
                    free.add(node)
                    continue
                raise NoMatch(f"the block also reads {node.name}, which is not one of its inputs", node)
            if node.op != "call_function" and node.op != "call_method":
                raise NoMatch(f"unexpected {node.op} node {node.name} inside the block", node)
            if _is_collective(node):  # verification would run it on probes, on this rank alone
                raise NoMatch(f"{node.name} is a collective inside the block", node)
            if _is_size_value(node) and not any(a in stop for a in node.all_input_nodes):
                free.add(node)
                continue
            inside.add(node)
            if op_name(node) in _SHAPE_ONLY and isinstance(node.args[0], fx.Node):
                shape_only.add(node.args[0])
                stack.extend(n for n in node.all_input_nodes if n is not node.args[0])
                continue
            stack.extend(node.all_input_nodes)

    for out in outputs:
        visit(out)
    order = {n: i for i, n in enumerate(outputs[0].graph.nodes)}
    end = max(order[o] for o in outputs)
    # Pull in writes into region tensors until nothing changes. A write placed after the last output is
    # not part of what the block computes (``dist.all_reduce(out)`` is a copy_ into it): a write into an
    # output itself stays outside, and the rewrite points it at the replacement's output; a later write
    # into anything else of the block (which an output may alias) refuses the match.
    later: list[fx.Node] = []  # writes into an output after the block
    changed = True
    while changed:
        changed = False
        for node in list(inside) + list(stop):
            for user in node.users:
                if user not in inside and is_mutation(user) and user.args and user.args[0] is node:
                    if node in stop:
                        raise NoMatch(f"{user.name} writes into the block input {node.name}", user)
                    if order[user] > end:
                        if node not in outputs:
                            raise NoMatch(f"{user.name} writes into {node.name}, a tensor of the block, after the block", user)
                        if user not in later:
                            later.append(user)
                        continue
                    inside.add(user)
                    for dep in user.all_input_nodes:
                        visit(dep)
                    changed = True
    for write in later:
        # The output may be a view of (or the same tensor as: ``.to`` to its own dtype) a tensor before it;
        # the write then changes that one too, which only the block's own nodes may see.
        node = write.args[0]
        while (node := _alias_source(node)) is not None:
            if node in stop or any(u not in inside for u in node.users):
                raise NoMatch(f"{write.name} writes into the block output {write.args[0].name}, which may share "
                              f"memory with {node.name}, read outside the block", write)
    free.update(n for n in shape_only if n not in inside and n not in stop)
    return Region(
        inputs=list(inputs),
        outputs=list(outputs),
        nodes=sorted(inside, key=order.__getitem__),
        free=sorted(free, key=order.__getitem__),
    )


def region_graph_module(region: Region) -> fx.GraphModule:
    """A standalone GraphModule computing the region: (inputs..., free...) -> outputs."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in region.inputs + region.free:
        env[node] = graph.placeholder(node.name)
    for node in region.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    outs = tuple(env[n] for n in region.outputs)
    graph.output(outs)
    return fx.GraphModule(torch.nn.Module(), graph)


def remove_region(region: Region):
    """Erase the region's nodes that nothing outside it needs any more.

    A node with users outside the region stays, and so do the nodes it needs
    and the writes into them: values used elsewhere are never lost.
    """
    inside = set(region.nodes)
    live: set[fx.Node] = set()
    stack = [n for n in region.nodes if any(u not in inside for u in n.users)]
    while stack:
        node = stack.pop()
        if node in live:
            continue
        live.add(node)
        stack.extend(a for a in node.all_input_nodes if a in inside)
        stack.extend(u for u in node.users if u in inside and is_mutation(u) and u.args[0] is node)
    removed = 0
    for node in reversed(region.nodes):
        if node not in live:
            node.graph.erase_node(node)
            removed += 1
    return removed


def describe_node(node: fx.Node | None) -> str:
    if node is None:
        return ""
    stack = node.meta.get("nn_module_stack")
    module = ""
    if stack:
        module = list(stack.values())[-1][0]
    return f"{node.name} ({module})" if module else node.name
