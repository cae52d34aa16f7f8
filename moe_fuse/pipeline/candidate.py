"""What a pattern module hands the pipeline: its registration, its proposed rewrites, its rejections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from ..spec import ExpertsSpec, RouterSpec
from .graph import Region, meta_value


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
    # Where op_args holds the op's save_h flag (keep h for the backward), for ops that have one. Inside an
    # activation-checkpointed body the pipeline sets it to False: the backward recomputes the block anyway.
    save_h_at: int | None = None

    def differentiated(self) -> bool:
        """Whether a gradient can flow through the region: grad mode on while the graph compiles and an input that
        requires one. An inference graph (compiled under no_grad, or over inputs none of which requires a gradient)
        never runs the op's backward: Dynamo guards both."""
        return torch.is_grad_enabled() and any(getattr(meta_value(n), "requires_grad", False)
                                               for n in self.region.inputs)

    def recompute_h(self) -> None:
        """Keep no h for the backward (the call's save_h False), where the op has the choice."""
        at = self.save_h_at
        if at is not None and self.op_args[at] is True:
            args = list(self.op_args)
            args[at] = False
            self.op_args = tuple(args)


@dataclass
class Rejection:
    """Something that looked like MoE and was left alone, and why."""

    pattern: str
    reason: str
    node: fx.Node | None = None


@dataclass(frozen=True)
class Pattern:
    """A pattern family of the find -> verify -> rewrite pipeline.

    ``find(graph)`` returns its Candidates and Rejections and never changes the graph: every pattern looks at
    the same untouched graph, each candidate is verified on probes, then rewritten.
    """

    name: str
    find: Callable[[fx.Graph], list]


@dataclass(frozen=True)
class GraphRewrite:
    """A rewrite that proves its matches itself, literal by literal, and changes the graph in place; for what
    probes cannot run (collectives) or need not (a constant, evaluated).

    ``run(module, report, where, values)`` rewrites ``module`` (a graph or a HOP body), reports each match and
    rejection, and returns whether it changed the graph; ``values`` is the pipeline's ``RealValues``. It reads
    its own switch from ``moe_fuse.config``.
    """

    name: str
    run: Callable[..., bool]
