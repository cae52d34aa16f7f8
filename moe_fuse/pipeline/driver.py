"""The pipeline over a Dynamo graph and the HOP bodies inside it.

For each graph, in the order ``moe_fuse.patterns`` lists them: the graph rewrites that come first
(``FIRST``), then every pattern's ``find`` on the same graph, each candidate verified on probes
(``moe_fuse.config.verify``) and the accepted ones rewritten in pattern order, then the graph rewrites
that come last (``LAST``). Every match and rejection goes to the report.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake

from .. import config
from .candidate import Candidate, Rejection
from .fake import set_fake_value
from .graph import meta_value
from .rewrite import rewrite
from .verify import verify


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


def _drop_kept_rows(graph: fx.Graph) -> bool:
    """``moe_fuse.keep_rows=False``: every experts call that keeps h for the backward keeps neither the sorted rows
    of x nor the weighted activation (ops.experts' keep_rows), whichever pattern wrote the call."""
    changed = False
    for node in graph.find_nodes(op="call_function", target=torch.ops.moe_fuse.experts.default):
        save_h = node.args[5] if len(node.args) > 5 else node.kwargs.get("save_h", False)
        if save_h is True:
            node.kwargs = {**node.kwargs, "keep_rows": False}
            set_fake_value(node)  # the outputs' metadata as the call now is (xs and aw empty)
            changed = True
    return changed


def _host_bound(cand: Candidate) -> str | None:
    """``dispatch.host_bound_step`` for the candidate's hidden states (its tokens, device, and whether a gradient
    flows through the region)."""
    from ..dispatch import host_bound_step

    values = [meta_value(n) for n in cand.region.inputs]
    hidden = [v for v, kind in zip(values, cand.input_kinds) if kind == "hidden" and isinstance(v, torch.Tensor)]
    if not hidden:
        return None
    x = hidden[0]
    return host_bound_step(x.numel() // x.shape[-1] if x.dim() else 1, x.device, cand.differentiated())


def match_and_rewrite(module: fx.GraphModule, patterns, where: str, values: RealValues, report,
                      checkpointed: bool) -> bool:
    """Find every pattern's candidates on ``module``'s graph, verify them, rewrite the accepted ones in pattern
    order; returns whether anything was rewritten."""
    found = [item for pattern in patterns for item in pattern.find(module.graph)]
    accepted: list[Candidate] = []
    for item in found:
        if isinstance(item, Rejection):
            report.reject(item.pattern, item.reason, where, item.node)
            continue
        reason = _host_bound(item)
        if reason is not None:
            report.reject(item.pattern, reason, where, item.anchor)
            continue
        if checkpointed:  # the backward recomputes h itself: saving it would make the partitioner re-run
            item.recompute_h()  # the whole fused forward in the backward just to rebuild h
        reason = verify(item, values) if config.verify else None
        if reason is not None:
            report.reject(item.pattern, reason, where, item.anchor, notes=item.notes)
        else:
            accepted.append(item)
    for cand in accepted:
        removed = rewrite(cand)
        report.match(cand, where, removed, verified=config.verify)
    return bool(accepted)


def run_passes(gm: fx.GraphModule, example_inputs, report):
    """Rewrite ``gm`` and its HOP bodies in place, as ``moe_fuse.config`` says; returns ``gm``."""
    from .. import patterns

    values = RealValues(gm, example_inputs)
    checkpointed = checkpointed_bodies(gm)
    for where, module in graphs_in(gm):
        changed = False
        for graph_rewrite in patterns.FIRST:
            changed = graph_rewrite.run(module, report, where, values) or changed
        rewritten = match_and_rewrite(module, patterns.PATTERNS, where, values, report, where in checkpointed)
        if rewritten and not config.keep_rows:
            _drop_kept_rows(module.graph)
        changed = rewritten or changed
        for graph_rewrite in patterns.LAST:
            changed = graph_rewrite.run(module, report, where, values) or changed
        if changed:
            module.graph.lint()
            module.recompile()
    return gm
