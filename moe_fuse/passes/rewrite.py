"""Replace a verified region by its fused op call."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.proxy import GraphAppendingTracer, Proxy

from .candidate import Candidate
from .graph import meta_value, remove_region


def _fake_result(cand: Candidate):
    """The op's output metadata, computed in the graph's own fake mode."""
    fakes = [meta_value(a) if isinstance(a, fx.Node) else a for a in cand.op_args]
    mode = next((f.fake_mode for f in fakes if hasattr(f, "fake_mode")), None)
    if mode is None:
        return None
    with mode:
        return cand.op(*fakes)


def _fake_mode(values):
    return next((v.fake_mode for v in values if hasattr(v, "fake_mode")), None)


def _insert_call(graph: fx.Graph, cand: Candidate) -> fx.Node:
    """The op call node. A custom op is one node; a Python function of the region inputs that calls
    it (reshapes, casts, a weight concatenation around the op) is traced into the graph, each new
    node with its fake value."""
    if isinstance(cand.op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        call = graph.call_function(cand.op, cand.op_args)
        call.meta["example_value"] = _fake_result(cand)
        return call
    before = set(graph.nodes)
    tracer = GraphAppendingTracer(graph)
    result = cand.op(*(Proxy(a, tracer) if isinstance(a, fx.Node) else a for a in cand.op_args))
    mode = _fake_mode(meta_value(a) for a in cand.op_args if isinstance(a, fx.Node))
    stack = cand.anchor.meta.get("nn_module_stack")
    for node in graph.nodes:
        if node in before:
            continue
        if stack:
            node.meta["nn_module_stack"] = stack
        if mode is None:
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), meta_value)
        with mode:
            if node.op == "call_method":
                node.meta["example_value"] = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                node.meta["example_value"] = node.target(*args, **kwargs)
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
    with graph.inserting_before(first):
        call = _insert_call(graph, cand)
        fake = call.meta.get("example_value")
        call.meta["moe_fuse"] = cand.pattern
        if cand.anchor.meta.get("nn_module_stack"):
            call.meta["nn_module_stack"] = cand.anchor.meta["nn_module_stack"]
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
