"""Replace a verified region by its fused op call."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.proxy import GraphAppendingTracer, Proxy

from .candidate import Candidate
from .fake import fake_mode_of, set_fake_value
from .graph import meta_value, remove_region


def insert_call(graph: fx.Graph, op, op_args: tuple, nn_module_stack=None) -> fx.Node:
    """``op(*op_args)`` as nodes of ``graph`` at its insertion point; returns the node of the result.

    A custom op is one node. A Python function of the nodes in ``op_args`` that calls one (reshapes, casts, a
    weight concatenation around the op) is traced into the graph, each new node with ``nn_module_stack`` when
    given. Every new node gets its fake value, in the fake mode of the arguments."""
    if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        call = graph.call_function(op, op_args)
        set_fake_value(call)
        return call
    before = set(graph.nodes)
    tracer = GraphAppendingTracer(graph)
    result = op(*(Proxy(a, tracer) if isinstance(a, fx.Node) else a for a in op_args))
    mode = fake_mode_of(meta_value(a) for a in op_args if isinstance(a, fx.Node))
    for node in graph.nodes:
        if node in before:
            continue
        if nn_module_stack:
            node.meta["nn_module_stack"] = nn_module_stack
        if mode is not None:
            set_fake_value(node, mode)
    return result.node


def rewrite(cand: Candidate) -> int:
    """Insert the op, redirect every outside use of the region's outputs, erase what is dead.

    Returns the number of nodes removed.
    """
    region = cand.region
    graph = region.outputs[0].graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    last_input = max(position[n] for n in region.inputs)
    first = next(n for n in region.nodes if position[n] > last_input)
    stack = cand.anchor.meta.get("nn_module_stack")
    with graph.inserting_before(first):
        call = insert_call(graph, cand.op, cand.op_args, stack)
        fake = call.meta.get("example_value")
        call.meta["moe_fuse"] = cand.pattern
        if stack:
            call.meta["nn_module_stack"] = stack
        outs = []
        for index in cand.output_index:
            if index is None:
                outs.append(call)
                continue
            item = graph.call_function(operator.getitem, (call, index))
            item.meta["example_value"] = fake[index] if fake is not None else None
            outs.append(item)
    inside = set(region.nodes)
    for old, new in zip(region.outputs, outs):
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in inside)
    removed = remove_region(region)
    for item in outs:
        if item is not call and not item.users:  # e.g. router logits nobody reads
            graph.erase_node(item)
    return removed
