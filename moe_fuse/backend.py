"""The ``moe_fuse`` torch.compile backend.

    torch.compile(model, backend="moe_fuse", options={"moe_fuse.debug_dir": "dumps"})

Takes moe_fuse's options out (``config.from_options``), runs the pipeline (find, verify, rewrite) on the Dynamo
graph under them, reports what happened (debug.py), then compiles the rewritten graph with the inner backend.
Registered through the ``torch_dynamo_backends`` entry point.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from pathlib import Path

import torch

from . import config, debug
from .pipeline import run_passes


def parse_options(options: dict | None, mode: str | None = None) -> tuple[dict, dict]:
    """(the settings of this compile: every ``config`` value with the compile's options and ``mode`` (torch.compile's
    ``mode=``, the same as ``moe_fuse.mode``) applied and debug_dir resolved, the options left for Inductor)."""
    ours, rest = config.from_options(options)
    if mode is not None:
        if ours.get("mode", mode) != mode:
            raise ValueError(f"mode={mode!r} and moe_fuse.mode={ours['mode']!r}: give one")
        ours.update(config._checked({"mode": mode}, prefix=""))
    settings = {**config.values(), **ours}
    if settings["debug_dir"] is None:
        settings["debug_dir"] = os.environ.get("MOE_FUSE_DEBUG_DIR") or None
    if settings["debug_dir"] is not None:
        settings["debug_dir"] = os.fspath(settings["debug_dir"])
    if rest and settings["inner"] != "inductor":
        raise ValueError(f"options {sorted(rest)} are for Inductor, but moe_fuse.inner={settings['inner']!r}")
    if settings["mode"] not in (None, "default") and settings["inner"] != "inductor":
        raise ValueError(f"mode={settings['mode']!r} is an Inductor mode, but moe_fuse.inner={settings['inner']!r}")
    return settings, rest


# The files that define moe_fuse's ops and decide what they save: their schemas and autograd formulas decide what
# a compiled backward graph calls.
_OP_SOURCES = ("ops.py", "router_ops.py", "dispatch.py", "parallel/ep_ops.py")


def cache_tag() -> str:
    """``moe_fuse-<hash of _OP_SOURCES>-<config.key()>``, added to torch.compile's cache keys around the inner
    compile.

    AOTAutograd's cache keys a compiled forward + backward by the forward graph, and the rewritten forward graph
    calls our ops the same way across versions while their backward may change (a new saved output, say). Without
    the tag, a graph cached by an older moe_fuse would run its old backward against the new ops (seen:
    "experts_backward() is missing value for argument 'xs'"). The settings are in it too: some are read when the
    backward is traced (``config.split_backward``) or decide what the forward saves (``config.grouped_mm``).
    """
    return f"moe_fuse-{_sources_hash()}-{config.key()}"


@functools.cache
def _sources_hash() -> str:
    digest = hashlib.sha256()
    root = Path(__file__).parent
    for name in _OP_SOURCES:
        digest.update((root / name).read_bytes())
    return digest.hexdigest()[:16]


def _tagged_caches(tag: str):
    compiler_config = getattr(torch.compiler, "config", None)
    if compiler_config is None or not hasattr(compiler_config, "cache_key_tag"):  # torch without the knob
        return contextlib.nullcontext()
    user_tag = compiler_config.cache_key_tag
    return compiler_config.patch(cache_key_tag=f"{user_tag}+{tag}" if user_tag else tag)


def _tagged_inner(tag: str):
    """Inductor's per-graph compile under ``tag``. AOTAutograd compiles the backward graph lazily, at the first
    backward, outside the backend call: without this its FX graph cache key would not name moe_fuse's version and
    settings (a backward cached against older op schemas would be reused)."""
    from torch._inductor.compile_fx import compile_fx_inner

    def inner(gm, example_inputs, **kwargs):  # torch 2.13 passes more keywords than 2.11
        with _tagged_caches(tag):
            return compile_fx_inner(gm, example_inputs, **kwargs)

    return inner


def inner_compile(gm, example_inputs, mode: str | None, inductor_options: dict):
    """Compile the rewritten graph with ``config.inner``, every cache keyed by ``cache_tag()`` as it is now; Inductor
    gets ``mode``'s settings and then ``inductor_options``, as torch.compile(mode=..., options=...) would give them."""
    if config.inner == "eager":
        return gm.forward
    tag = cache_tag()
    with _tagged_caches(tag):
        if config.inner == "aot_eager":
            from torch._dynamo.backends.registry import lookup_backend

            return lookup_backend("aot_eager")(gm, example_inputs)
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        options = {**(list_mode_options(mode) if mode else {}), **inductor_options}
        return compile_fx(model_=gm, example_inputs_=example_inputs, inner_compile=_tagged_inner(tag),
                          config_patches=options or None)


def moe_fuse_backend(gm: torch.fx.GraphModule, example_inputs, *, mode: str | None = None, options=None):
    settings, inductor_options = parse_options(options, mode)
    with config.patch(settings):
        report = debug.new_report()
        debug.note_eager_checkpoints(report)
        before = debug.graph_code(gm)
        run_passes(gm, example_inputs, report)
        after = debug.graph_code(gm)
        debug.emit(report, before, after, config.debug_dir)
        return inner_compile(gm, example_inputs, config.mode, inductor_options)


def explain(model, *args, options: dict | None = None, **kwargs) -> debug.Explanation:
    """Compile ``model`` with moe_fuse, run it once on the given inputs, return what was rewritten.

    Like ``torch._dynamo.explain`` it resets Dynamo first, so every graph is compiled afresh. The rewritten graphs
    run eagerly (``moe_fuse.inner="eager"``) unless ``options`` says otherwise.
    """
    torch._dynamo.reset()
    opts = {"moe_fuse.inner": "eager", **(options or {})}
    compiled = torch.compile(model, backend=lambda gm, ex: moe_fuse_backend(gm, ex, options=opts))
    with debug.collect_reports() as sink:
        compiled(*args, **kwargs)
    torch._dynamo.reset()
    return debug.Explanation(list(sink))
