"""The generic machinery that turns matches into rewrites: find -> verify -> rewrite -> report.

- ``driver``: ``run_passes`` over a graph and its HOP bodies, in the order ``moe_fuse.patterns`` lists;
- ``candidate``: what a pattern hands in (``Pattern``, ``GraphRewrite``, ``Candidate``, ``Rejection``);
- ``graph``: FX helpers for the walks (op names, arguments, regions);
- ``verify``: a candidate against its region on random probes;
- ``rewrite``: a verified region replaced by its op call;
- ``fake``: fake values of new or changed nodes.

The patterns themselves are in ``moe_fuse.patterns``.
"""

from .driver import run_passes

__all__ = ["run_passes"]
