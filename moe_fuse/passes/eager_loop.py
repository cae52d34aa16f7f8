"""transformers' ``eager`` experts implementation: a Python loop over experts.

It opens with ``one_hot(top_k_index, num_classes=E + 1).permute(2, 1, 0)`` and
``.sum(...) > 0`` followed by ``nonzero()``: Dynamo breaks the graph there (or,
with fullgraph=True, has to unroll a data-dependent loop), so no graph ever
holds the whole block. We recognise the prelude and say so instead of fusing.
"""

from __future__ import annotations

import torch.fx as fx

from .candidate import Rejection
from .graph import arg, is_op

PATTERN = "eager_experts_loop"

REASON = (
    "transformers' 'eager' experts implementation loops over experts in Python and Dynamo splits it "
    "at nonzero()/where() into per-expert pieces, so no graph holds the whole MoE block and nothing is "
    "fused (results are unchanged). Use the default experts implementation: "
    "config._experts_implementation = 'grouped_mm' (or model.set_experts_implementation('grouped_mm'))."
)


def find(graph: fx.Graph) -> list[Rejection]:
    for node in graph.nodes:
        if is_op(node, "one_hot") and any(is_op(u, "permute") for u in node.users):
            classes = arg(node, 1, "num_classes", -1)
            if isinstance(classes, int) and classes > 1:
                return [Rejection(PATTERN, REASON, node)]
    return []
