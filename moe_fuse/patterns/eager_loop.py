"""A Python loop over experts: transformers' ``eager`` experts implementation, or a family's own loop.

It opens with ``one_hot(top_k_index, num_classes=E [+ 1]).permute(...)`` and ``.sum(...) > 0``
followed by ``nonzero()``: Dynamo breaks the graph there (or, with fullgraph=True, has to unroll a
data-dependent loop), so no graph ever holds the whole block. We recognise the prelude and say so
instead of fusing, with the advice that fits the module running the loop:

- an experts module of transformers' experts interface (``@use_experts_implementation``, the
  ``eager`` setting): switch the model to ``grouped_mm``, which moe_fuse fuses;
- a module with its own loop in its modeling code (dbrx, nllb_moe, step3p7, longcat_flash in
  transformers 5.24): there is no setting to switch; the loop cannot be captured as one graph.
"""

from __future__ import annotations

import inspect
import re
import sys

import torch.fx as fx

from ..pipeline.candidate import Pattern, Rejection
from ..pipeline.graph import arg, is_op

NAME = "eager_experts_loop"

REASON = (
    "transformers' 'eager' experts implementation loops over experts in Python and Dynamo splits it "
    "at nonzero()/where() into per-expert pieces, so no graph holds the whole MoE block and nothing is "
    "fused (results are unchanged). Use the default experts implementation: "
    "config._experts_implementation = 'grouped_mm' (or model.set_experts_implementation('grouped_mm'))."
)

OWN_LOOP_REASON = (
    "{cls} runs its experts as a Python loop in its own modeling code ({file}), and Dynamo splits the loop "
    "at nonzero()/where() into per-expert pieces, so no graph holds the whole MoE block and nothing is "
    "fused (results are unchanged). There is no experts implementation to switch: {cls} does not use "
    "transformers' experts interface, and this loop cannot be captured as one graph."
)


def uses_experts_interface(cls) -> bool:
    """Whether a module class dispatches through transformers' experts interface
    (its forward is the ``@use_experts_implementation`` wrapper)."""
    forward = getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    return (
        hasattr(forward, "__wrapped__")
        and code is not None
        and code.co_filename.replace("\\", "/").endswith("transformers/integrations/moe.py")
    )


def _class_at(path: str, line: int, func: str):
    """The class of an imported module whose method ``func`` holds line ``line`` of file ``path``."""
    module = next((m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == path), None)
    for cls in vars(module).values() if module is not None else ():
        if not (isinstance(cls, type) and cls.__module__ == module.__name__ and func in vars(cls)):
            continue
        code = getattr(inspect.unwrap(vars(cls)[func]), "__code__", None)
        lines = [n for _, _, n in code.co_lines() if n] if code is not None else []
        if code is not None and code.co_filename == path and lines and min(lines) <= line <= max(lines):
            return cls
    return None


def _loop_owner(node: fx.Node):
    """The innermost module class that runs ``node``: from Dynamo's nn_module_stack, else from the
    node's stack trace (a graph that starts inside a module's forward has no module stack)."""
    stack = node.meta.get("nn_module_stack") or {}
    for _path, cls in reversed(list(stack.values())):
        if isinstance(cls, type):
            return cls
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', node.meta.get("stack_trace") or "")
    for path, line, func in reversed(frames):
        cls = _class_at(path, int(line), func)
        if cls is not None:
            return cls
    return None


def reason_for(node: fx.Node) -> str:
    cls = _loop_owner(node)
    if cls is None or uses_experts_interface(cls):
        return REASON
    file = (cls.__module__ or "").replace(".", "/") + ".py"
    return OWN_LOOP_REASON.format(cls=cls.__name__, file=file)


def find(graph: fx.Graph) -> list[Rejection]:
    for node in graph.nodes:
        if is_op(node, "one_hot") and any(is_op(u, "permute") for u in node.users):
            classes = arg(node, 1, "num_classes", -1)
            if isinstance(classes, int) and classes > 1:
                return [Rejection(NAME, reason_for(node), node)]
    return []


PATTERN = Pattern(NAME, find)
