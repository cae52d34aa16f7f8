"""Every switch and threshold of moe_fuse, in one place.

Read a setting as ``config.<name>``. Change it for a block of code with ``config.patch``, a context manager and
a decorator, as ``torch._inductor.config.patch``::

    from moe_fuse import config
    with config.patch(verify=False, ragged_min_rows=0):
        ...

The settings marked ``option`` below are also ``torch.compile`` options, prefixed with ``moe_fuse.``; they
apply to that compile only::

    torch.compile(model, backend="moe_fuse", options={"moe_fuse.verify": False})

The kernel settings are read when the compiled code runs, and the op's fake implementation reads them while
tracing: change them around both (``config.patch`` around the compile and the steps), not in between. Every
setting is part of the compile cache key (``backend.cache_tag``), and ``explain()`` and the debug summary
print them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

INNER_BACKENDS = ("inductor", "aot_eager", "eager")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's mode=


@dataclass(frozen=True)
class Setting:
    default: Any
    doc: str
    check: Callable[[Any], bool]
    expected: str
    option: bool = False  # a torch.compile option ("moe_fuse.<name>")


def _bool(v) -> bool:
    return isinstance(v, bool)


def _positive_int_or_none(v) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1)


def _rows(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


SETTINGS: dict[str, Setting] = {
    # ---- the backend: what a compile does
    "inner": Setting("inductor", "what compiles the rewritten graph", lambda v: v in INNER_BACKENDS,
                     f"one of {', '.join(INNER_BACKENDS)}", option=True),
    "mode": Setting(None, "Inductor's mode for the rewritten graph, as torch.compile's mode= (which takes no "
                    "options with it); torch.compile(mode=...) sets it too", lambda v: v is None or v in MODES,
                    f"one of {', '.join(map(repr, MODES))} or None", option=True),
    "debug_dir": Setting(None, "folder for the dumps (None: $MOE_FUSE_DEBUG_DIR, else no dumps)",
                         lambda v: v is None or isinstance(v, (str, os.PathLike)), "a folder path or None",
                         option=True),
    "verify": Setting(True, "prove each match on random probes before rewriting it", _bool, "True or False",
                      option=True),
    "verify_tokens": Setting(1024, "verification proves an experts block on at most this many tokens where every "
                             "size-bearing literal of it is the token count (its memory then a fraction of the "
                             "step's); 0: always at the real size", _rows, "an int >= 0", option=True),
    "causal_sdpa": Setting(True, "turn a constant plain-causal SDPA mask into is_causal=True", _bool,
                           "True or False", option=True),
    "causal_sdpa_flex": Setting(True, "the mask rewrite also takes a causal mask AND a key padding mask (a "
                                "tokenizer's attention_mask), and the mask of sequences packed into rows "
                                "(position_ids): one FlexAttention call on a GPU", _bool, "True or False",
                                option=True),
    "causal_sdpa_grouped_heads": Setting(True, "the causal-mask rewrite also takes SDPA calls whose key / value "
                                         "heads were repeated for grouped-query attention (passes enable_gqa)",
                                         _bool, "True or False", option=True),
    "keep_rows": Setting(True, "keep the expert-sorted rows of x for the backward (False: k*T*H fewer elements "
                         "held per MoE layer, a slower backward; also drops what keep_activation keeps)", _bool,
                         "True or False", option=True),
    "ep_chunks": Setting(None, "expert parallelism: replace TorchTitan's all-to-all dispatch chain by the chunked, "
                         "overlapped moe_fuse.ep_experts op with this many expert groups (None: leave it)",
                         _positive_int_or_none, "a positive int or None", option=True),
    # ---- the kernels: read where the ops run (and by their fake implementations)
    "grouped_mm": Setting(True, "on CUDA sm90+ in bf16, run the training experts as GEMMs on expert-sorted rows "
                          "(kernels/grouped_mm_path.py); False: the fused Triton GEMMs everywhere", _bool,
                          "True or False"),
    "ragged_gemm": Setting(True, "on the grouped_mm path, the four row-ragged GEMMs through the Triton ragged GEMM "
                           "(from ragged_min_rows routed rows up) rather than torch._grouped_mm", _bool,
                           "True or False"),
    "ragged_min_rows": Setting(65536, "routed rows (T*k) from which the Triton ragged GEMM runs; below it, its host "
                               "cost outweighs its gain", _rows, "an int >= 0"),
    "inference_grouped_mm": Setting(None, "the forward that keeps nothing for a backward (inference, checkpointed "
                                    "layers): True grouped_mm path, False fused Triton GEMMs, None: grouped_mm "
                                    "path when the routing weights are wider than x or the experts inference_min_width "
                                    "wide", lambda v: v in (None, True, False), "True, False or None"),
    "inference_min_width": Setting(1024, "experts' intermediate size from which the forward that keeps nothing takes "
                                   "the grouped_mm path by default (narrower: the fused Triton GEMMs, the faster there)",
                                   _rows, "an int >= 0"),
    "keep_activation": Setting(False, "the grouped_mm path's training forward, with keep_rows, also keeps the "
                               "weighted activation for dW_down (k*T*I more elements held per MoE layer; the "
                               "backward frees the sorted dy sooner: a lower peak for a lone layer). False: the "
                               "dSwiGLU pass writes it again", _bool, "True or False"),
    "split_backward": Setting(True, "the grouped_mm path's training backward as three ops (frees h and aw after the "
                              "first) rather than one", _bool, "True or False"),
    "overlap_wgrad": Setting(True, "fused Triton backward: the weight gradients on a side stream, overlapping the "
                             "data gradients", _bool, "True or False"),
    "direct_launch": Setting(True, "launch compiled Triton kernels seen before without JITFunction.run's Python "
                             "(on the triton minor version it was checked on)", _bool, "True or False"),
    "flash_prefix": Setting(True, "the padded-mask attention in two kernels: the queries before each row's first "
                            "padded key through SDPA is_causal=True (flash attention), the rest through "
                            "FlexAttention; a where keeps each row (exact; under left padding the SDPA call is "
                            "wasted). False: FlexAttention alone", _bool, "True or False"),
    "small_step_tokens": Setting(64, "an inference graph of at most this many tokens (a decode step) on a GPU is left "
                                 "to Inductor unless it runs under CUDA graphs (mode reduce-overhead): host-bound, "
                                 "and the fused ops issue more host work (0: fuse every size)", _rows, "an int >= 0"),
}

# The current values; ``patch`` changes them. Kept as plain module attributes: the ops read some on every call.
inner: str = "inductor"
mode: str | None = None
debug_dir: str | None = None
verify: bool = True
verify_tokens: int = 1024
causal_sdpa: bool = True
causal_sdpa_flex: bool = True
causal_sdpa_grouped_heads: bool = True
keep_rows: bool = True
ep_chunks: int | None = None
grouped_mm: bool = True
ragged_gemm: bool = True
ragged_min_rows: int = 65536
inference_grouped_mm: bool | None = None
inference_min_width: int = 1024
keep_activation: bool = False
split_backward: bool = True
overlap_wgrad: bool = True
direct_launch: bool = True
flash_prefix: bool = True
small_step_tokens: int = 64

_this = sys.modules[__name__]
assert all(getattr(_this, name) == s.default for name, s in SETTINGS.items()), "a default differs from SETTINGS"


def _checked(changes: dict, prefix: str = "moe_fuse setting ") -> dict:
    unknown = sorted(set(changes) - set(SETTINGS))
    if unknown:
        valid = "\n".join(f"  {name}: {s.doc}" for name, s in SETTINGS.items())
        raise ValueError(f"unknown moe_fuse setting(s) {unknown}; the settings are:\n{valid}")
    for name, value in changes.items():
        s = SETTINGS[name]
        if not s.check(value):
            raise ValueError(f"{prefix}{name}={value!r}; expected {s.expected}")
    return changes


class patch(contextlib.ContextDecorator):
    """``with config.patch(name=value, ...):`` or ``@config.patch(...)``: the settings changed inside, restored
    after (also on an exception). Names and values are checked when the patch is made."""

    def __init__(self, changes: dict | None = None, **kwargs):
        self.changes = _checked({**(changes or {}), **kwargs})
        self._saved: list[dict] = []

    def __enter__(self):
        self._saved.append({name: getattr(_this, name) for name in self.changes})
        for name, value in self.changes.items():
            setattr(_this, name, value)
        return self

    def __exit__(self, *exc):
        for name, value in self._saved.pop().items():
            setattr(_this, name, value)
        return False


def values() -> dict:
    """Every setting's current value, by name."""
    return {name: getattr(_this, name) for name in SETTINGS}


def changed() -> dict:
    """The settings that differ from their defaults."""
    return {name: v for name, v in values().items() if v != SETTINGS[name].default}


def key() -> str:
    """A short hash of every current value (part of the compile cache tag)."""
    return hashlib.sha256(repr(sorted(values().items())).encode()).hexdigest()[:12]


def describe() -> str:
    """One line per setting: name = value, marking those not at their default."""
    return "\n".join(f"  {name} = {v!r}{'' if v == SETTINGS[name].default else '   (changed)'}"
                     for name, v in values().items())


def from_options(options: dict | None) -> tuple[dict, dict]:
    """Split ``torch.compile`` options into moe_fuse's (``moe_fuse.<name>``, checked, prefix removed) and the rest
    (for Inductor). A moe_fuse setting given without the prefix, or a kernel setting (not an option), is an
    error naming the fix."""
    rest = dict(options or {})
    ours = {key[len("moe_fuse."):]: rest.pop(key) for key in list(rest) if key.startswith("moe_fuse.")}
    valid = "\n".join(f"  moe_fuse.{name}: {s.doc} (default {s.default!r})"
                      for name, s in SETTINGS.items() if s.option)
    unknown = sorted(name for name in ours if name not in SETTINGS or not SETTINGS[name].option)
    if unknown:
        kernel = [n for n in unknown if n in SETTINGS]
        hint = (f"\n{', '.join(kernel)}: kernel settings, read where the ops run; set them with "
                f"moe_fuse.config.patch(...) around the compile and the steps" if kernel else "")
        raise ValueError(f"unknown moe_fuse option(s) {['moe_fuse.' + n for n in unknown]}; valid options are:\n"
                         f"{valid}{hint}")
    bare = sorted(k for k in rest if k in SETTINGS and SETTINGS[k].option)
    if bare:
        raise ValueError(f"option(s) {bare} look like moe_fuse's; moe_fuse options take the prefix "
                         f"'moe_fuse.' ({', '.join('moe_fuse.' + k for k in bare)})")
    return _checked(ours, prefix="moe_fuse."), rest
