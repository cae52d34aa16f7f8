"""A proposed rewrite, as the pattern modules hand it to verify and rewrite."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from ..spec import ExpertsSpec, RouterSpec
from .graph import Region


@dataclass
class Candidate:
    """Replace ``region`` by ``op(*op_args)``.

    ``op`` is a custom op, or a Python function that calls one with a few tensor ops around it
    (reshapes, casts, a weight concatenation): the rewrite traces such a function into the graph.

    ``op_args`` are region inputs (fx nodes) or literals. ``output_index[i]`` is
    the element of the op's result that stands for ``region.outputs[i]`` (None
    when the op returns a single tensor). ``input_kinds`` tells verification how
    to draw probes for each region input: "hidden", "param", "expert_ids",
    "routing_weights".
    """

    pattern: str
    spec: RouterSpec | ExpertsSpec
    region: Region
    op: object
    op_args: tuple
    output_index: list[int | None]
    input_kinds: list[str]
    anchor: fx.Node
    # (weights, ids) positions in region.outputs when they are a top-k selection:
    # the order of equal weights within a row is not part of the meaning.
    topk_outputs: tuple[int, int] | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Rejection:
    """Something that looked like MoE and was left alone, and why."""

    pattern: str
    reason: str
    node: fx.Node | None = None
