"""The patterns, one module per family, in the order the pipeline runs them (``moe_fuse.pipeline``).

Each pattern module registers itself with a module-level ``PATTERN = Pattern(NAME, find)`` (found, verified on
probes, rewritten by the pipeline) or ``REWRITE = GraphRewrite(NAME, run)`` (proved literal by literal and
rewritten by the module itself). This file lists them in their order; on every graph and HOP body:

- ``FIRST``: the expert-parallel dispatch chain (opt-in, ``config.ep_chunks``), before any pattern sees the
  grouped GEMMs inside it;
- ``PATTERNS``: found together on the same graph, then rewritten in this order: the experts before the routers
  (an experts op reads the router's outputs, which the router rewrite then redirects), then the diagnostics,
  which only report;
- ``LAST``: the attention-mask rewrite (``config.causal_sdpa``).
"""

from __future__ import annotations

from . import (
    causal_mask,
    eager_loop,
    ep_torchtitan,
    experts_batched_mm,
    experts_dense,
    experts_grouped_mm,
    experts_torchtitan,
    router_sigmoid,
    router_softmax,
    router_topk_softmax,
    router_unmatched,
)

FIRST = (ep_torchtitan.REWRITE,)

PATTERNS = (
    # experts spellings
    experts_grouped_mm.PATTERN,
    experts_batched_mm.PATTERN,
    experts_dense.PATTERN,
    experts_torchtitan.PATTERN,
    # routers
    router_softmax.PATTERN,
    router_sigmoid.PATTERN,
    router_topk_softmax.PATTERN,
    # diagnostics: rejections only
    router_unmatched.PATTERN,
    eager_loop.PATTERN,
)

LAST = (causal_mask.REWRITE,)
