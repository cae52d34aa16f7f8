"""The ``moe_fuse`` torch.compile backend.

    torch.compile(model, backend="moe_fuse", options={"moe_fuse.debug_dir": "dumps"})

Runs the passes (find, describe, verify, rewrite) on the Dynamo graph,
reports what happened, then compiles the rewritten graph with the inner
backend. Registered through the ``torch_dynamo_backends`` entry point.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import debug
from .passes import run_passes

INNER_BACKENDS = ("inductor", "aot_eager", "eager")
OPTION_DOCS = {
    "moe_fuse.inner": f"what compiles the rewritten graph: one of {', '.join(INNER_BACKENDS)} (default inductor)",
    "moe_fuse.debug_dir": "folder for the dumps (default: $MOE_FUSE_DEBUG_DIR, else none)",
    "moe_fuse.verify": "prove each match on random probes before rewriting it (default True)",
    "moe_fuse.causal_sdpa": "turn a constant plain-causal SDPA mask into is_causal=True, with grouped key / value heads "
    "(default True)",
    "moe_fuse.keep_rows": "keep the expert-sorted rows of x and the weighted activation for the backward (default "
    "True; False: k*T*(H + I) fewer elements held per MoE layer, a slower backward)",
    "moe_fuse.ep_chunks": "expert parallelism: replace TorchTitan's all-to-all dispatch chain by the chunked, "
    "overlapped moe_fuse.ep_experts op with this many expert groups (default None: left as it is)",
}


@dataclass(frozen=True)
class Options:
    inner: str = "inductor"
    debug_dir: str | None = None
    verify: bool = True
    causal_sdpa: bool = True
    ep_chunks: int | None = None
    keep_rows: bool = True


def parse_options(options: dict | None) -> tuple[Options, dict]:
    """Split ``options`` into moe_fuse's own (checked) and the rest, for Inductor."""
    rest = dict(options or {})
    ours = {key: rest.pop(key) for key in list(rest) if key.startswith("moe_fuse.")}
    unknown = sorted(set(ours) - set(OPTION_DOCS))
    if unknown:
        valid = "\n".join(f"  {k}: {doc}" for k, doc in OPTION_DOCS.items())
        raise ValueError(f"unknown moe_fuse option(s) {unknown}; valid options are:\n{valid}")
    inner = ours.get("moe_fuse.inner", "inductor")
    if inner not in INNER_BACKENDS:
        raise ValueError(f"moe_fuse.inner={inner!r}; expected one of {INNER_BACKENDS}")
    verify = ours.get("moe_fuse.verify", True)
    if not isinstance(verify, bool):
        raise ValueError(f"moe_fuse.verify={verify!r}; expected True or False")
    causal_sdpa = ours.get("moe_fuse.causal_sdpa", True)
    if not isinstance(causal_sdpa, bool):
        raise ValueError(f"moe_fuse.causal_sdpa={causal_sdpa!r}; expected True or False")
    keep_rows = ours.get("moe_fuse.keep_rows", True)
    if not isinstance(keep_rows, bool):
        raise ValueError(f"moe_fuse.keep_rows={keep_rows!r}; expected True or False")
    ep_chunks = ours.get("moe_fuse.ep_chunks", None)
    if ep_chunks is not None and (not isinstance(ep_chunks, int) or isinstance(ep_chunks, bool) or ep_chunks < 1):
        raise ValueError(f"moe_fuse.ep_chunks={ep_chunks!r}; expected a positive int or None")
    debug_dir = ours.get("moe_fuse.debug_dir", os.environ.get("MOE_FUSE_DEBUG_DIR") or None)
    if debug_dir is not None and not isinstance(debug_dir, (str, os.PathLike)):
        raise ValueError(f"moe_fuse.debug_dir={debug_dir!r}; expected a folder path")
    if rest and inner != "inductor":
        raise ValueError(f"options {sorted(rest)} are for Inductor, but moe_fuse.inner={inner!r}")
    return Options(inner, os.fspath(debug_dir) if debug_dir else None, verify, causal_sdpa, ep_chunks, keep_rows), rest


# The files that define moe_fuse's ops: their schemas and autograd formulas decide what a compiled
# backward graph calls.
_OP_SOURCES = ("ops.py", "router_ops.py", "parallel/ep_ops.py")


def cache_tag() -> str:
    """``moe_fuse-<hash of _OP_SOURCES>``, added to torch.compile's cache keys around the inner compile.

    AOTAutograd's cache keys a compiled forward + backward by the forward graph, and the rewritten
    forward graph calls our ops the same way across versions while their backward may change (a
    new saved output, say). Without the tag, a graph cached by an older moe_fuse would run its old
    backward against the new ops (seen: "experts_backward() is missing value for argument 'xs'").
    ``ops.SPLIT_BACKWARD`` off (an A/B switch read when the backward is traced) adds ``-one-op``.
    """
    from . import ops

    return "moe_fuse-" + _sources_hash() + ("" if ops.SPLIT_BACKWARD else "-one-op")


@functools.cache
def _sources_hash() -> str:
    digest = hashlib.sha256()
    root = Path(__file__).parent
    for name in _OP_SOURCES:
        digest.update((root / name).read_bytes())
    return digest.hexdigest()[:16]


def _tagged_caches():
    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "cache_key_tag"):  # torch without the knob: nothing to tag
        return contextlib.nullcontext()
    user_tag = config.cache_key_tag
    return config.patch(cache_key_tag=f"{user_tag}+{cache_tag()}" if user_tag else cache_tag())


def inner_compile(gm, example_inputs, opts: Options, mode: str | None, inductor_options: dict):
    if opts.inner == "eager":
        return gm.forward
    with _tagged_caches():
        if opts.inner == "aot_eager":
            from torch._dynamo.backends.registry import lookup_backend

            return lookup_backend("aot_eager")(gm, example_inputs)
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        config = {**(list_mode_options(mode) if mode else {}), **inductor_options}
        return compile_fx(model_=gm, example_inputs_=example_inputs, config_patches=config or None)


def moe_fuse_backend(gm: torch.fx.GraphModule, example_inputs, *, mode: str | None = None, options=None):
    opts, inductor_options = parse_options(options)
    if mode is not None and opts.inner != "inductor":
        raise ValueError(f"mode={mode!r} is an Inductor mode, but moe_fuse.inner={opts.inner!r}")
    report = debug.new_report()
    before = debug.graph_code(gm)
    run_passes(gm, example_inputs, report, verify_matches=opts.verify, causal_sdpa=opts.causal_sdpa,
               ep_chunks=opts.ep_chunks, keep_rows=opts.keep_rows)
    after = debug.graph_code(gm)
    debug.emit(report, before, after, opts.debug_dir)
    return inner_compile(gm, example_inputs, opts, mode, inductor_options)
