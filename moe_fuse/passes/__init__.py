"""find -> describe -> verify -> rewrite, over a Dynamo graph and the HOP bodies inside it.

Each pattern family is one module with ``find(graph)``, returning candidates
(already described by a spec) and rejections. Candidates are all verified on
the untouched graph, then rewritten: experts first, because their fused op
reads the router's outputs, which the router rewrite then redirects.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake

from . import (
    batched_mm,
    causal_mask,
    dense_experts,
    eager_loop,
    grouped_mm,
    router,
    router_detect,
    sigmoid_router,
    topk_softmax_router,
    torchtitan,
)
from .candidate import Candidate, Rejection
from .graph import meta_value
from .rewrite import rewrite
from .verify import verify

PATTERN_MODULES = (grouped_mm, batched_mm, dense_experts, torchtitan, router, sigmoid_router, topk_softmax_router,
                   router_detect, eager_loop)  # also the rewrite order


class RealValues:
    """Maps a graph input to the real tensor behind it, when there is one.

    Top-level placeholders map to the backend's example inputs; a placeholder
    of a HOP body (activation checkpointing's ``wrap_body_0``) maps to the
    argument the HOP passes for it, and so on outwards.
    """

    def __init__(self, gm: fx.GraphModule, example_inputs):
        self.real = {}
        self.alias = {}
        top = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, value in zip(top, example_inputs):
            if isinstance(value, torch.Tensor) and not is_fake(value):
                self.real[node] = value
        for owner in gm.modules():
            if not isinstance(owner, fx.GraphModule):
                continue
            for node in owner.graph.nodes:
                if node.op != "call_function" or not node.args:
                    continue
                body = node.args[0]
                if not (isinstance(body, fx.Node) and body.op == "get_attr"):
                    continue
                sub = getattr(owner, body.target, None)
                if isinstance(sub, fx.GraphModule):
                    params = [n for n in sub.graph.nodes if n.op == "placeholder"]
                    for param, outer in zip(params, node.args[1:]):
                        if isinstance(outer, fx.Node):
                            self.alias[param] = outer

    def __call__(self, node: fx.Node):
        seen = set()
        while node in self.alias and node not in seen:
            seen.add(node)
            node = self.alias[node]
        return self.real.get(node)


def graphs_in(gm: fx.GraphModule):
    """The graph itself, then every nested GraphModule (HOP bodies), with a name."""
    yield "", gm
    for name, module in gm.named_modules():
        if module is not gm and isinstance(module, fx.GraphModule):
            yield name, module


def checkpointed_bodies(gm: fx.GraphModule) -> set[str]:
    """Qualified names of the bodies of activation-checkpointing HOPs (``tag_activation_checkpoint``)."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    names = set()
    for prefix, owner in gm.named_modules():
        if not isinstance(owner, fx.GraphModule):
            continue
        for node in owner.graph.nodes:
            if node.op == "call_function" and node.target is hop and node.args and isinstance(node.args[0], fx.Node):
                names.add(f"{prefix}.{node.args[0].target}" if prefix else node.args[0].target)
    return names


def _recompute_h(cand: Candidate) -> None:
    """Inside a checkpointed body the backward recomputes h itself: saving it would make the partitioner
    re-run the whole fused forward in the backward just to rebuild h."""
    # save_h: moe_fuse.experts(x, ids, weights, W_gu, W_d, save_h[, swiglu_limit]); experts_call(..., save_h);
    # dense_experts.DenseAsRouted(x, logits, W_gu, W_d, save_h, ...)
    at = {torch.ops.moe_fuse.experts.default: 5, grouped_mm.experts_from_transposed: 5,
          torchtitan.experts_call: -1}.get(cand.op, getattr(cand.op, "save_h_at", None))
    if at is not None and cand.op_args[at] is True:
        args = list(cand.op_args)
        args[at] = False
        cand.op_args = tuple(args)


def _rewrite_ep_dispatch(module: fx.GraphModule, chunks: int, report, where: str) -> None:
    """TorchTitan's all-to-all dispatch chain -> moe_fuse.ep_experts (ep_torchtitan.py), before the other
    patterns see the grouped GEMMs inside it."""
    from . import ep_torchtitan  # imports torch.distributed pieces: only when asked for

    _, rejections = ep_torchtitan.rewrite(module, chunks)
    for r in rejections:
        report.reject(ep_torchtitan.PATTERN, r.reason, where, r.node)
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.moe_fuse.ep_experts.default:
            report.rewrite(ep_torchtitan.PATTERN, where, node, {"chunks": node.args[-1], "group": node.args[-2]})


def _drop_kept_rows(graph: fx.Graph) -> bool:
    """``moe_fuse.keep_rows=False``: every experts call that keeps h for the backward keeps neither the sorted rows
    of x nor the weighted activation (ops.experts' keep_rows), whichever pattern wrote the call."""
    changed = False
    for node in graph.find_nodes(op="call_function", target=torch.ops.moe_fuse.experts.default):
        save_h = node.args[5] if len(node.args) > 5 else node.kwargs.get("save_h", False)
        if save_h is True:
            node.kwargs = {**node.kwargs, "keep_rows": False}
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), meta_value)
            mode = next((v.fake_mode for v in args if hasattr(v, "fake_mode")), None)
            if mode is not None:  # the outputs' metadata as the call now is (xs and aw empty)
                with mode:
                    node.meta["example_value"] = node.target(*args, **kwargs)
            changed = True
    return changed


def run_passes(gm: fx.GraphModule, example_inputs, report, verify_matches: bool = True, causal_sdpa: bool = True,
               ep_chunks: int | None = None, keep_rows: bool = True):
    values = RealValues(gm, example_inputs)
    checkpointed = checkpointed_bodies(gm)
    for where, module in graphs_in(gm):
        if ep_chunks is not None:  # opt-in (a collective cannot be probed): proved literal by literal instead
            _rewrite_ep_dispatch(module, ep_chunks, report, where)
        found = [f for mod in PATTERN_MODULES for f in mod.find(module.graph)]
        accepted: list[Candidate] = []
        for item in found:
            if isinstance(item, Rejection):
                report.reject(item.pattern, item.reason, where, item.node)
                continue
            if where in checkpointed:
                _recompute_h(item)
            reason = verify(item, values) if verify_matches else None
            if reason is not None:
                report.reject(item.pattern, reason, where, item.anchor, notes=item.notes)
            else:
                accepted.append(item)
        changed = False
        for cand in accepted:
            removed = rewrite(cand)
            report.match(cand, where, removed, verified=verify_matches)
            changed = True
        if changed and not keep_rows:
            _drop_kept_rows(module.graph)
        if causal_sdpa:  # not MoE, but the attention half of the same training step (causal_mask.py says why)
            changed = causal_mask.rewrite_graph(module.graph, report, where, values.alias) or changed
        if changed:
            module.graph.lint()
            module.recompile()
    return gm
