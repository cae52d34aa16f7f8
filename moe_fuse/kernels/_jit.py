"""Launch-time choice between the Triton compiler and the Triton interpreter.

``@triton.jit`` decides at decoration time (module import) whether a kernel is
compiled or interpreted, from ``TRITON_INTERPRET``. A test that sets the
variable after some other module imported this package would then get
compiled kernels on CPU tensors. ``lazy_jit`` defers that decision to the
first launch under each setting, so the flag is read at call time.

Kernels wrapped this way must not call other ``@triton.jit`` helpers: a helper
would be fixed at import time and could disagree with its caller. Each kernel
here is therefore self-contained.

Triton's own library functions (``tl.sum``, ``tl.cumsum``, ``tl.sigmoid``) are
jitted when ``triton.language`` is first imported, so the interpreter works
only if TRITON_INTERPRET was set by then: ``interpreter_usable`` checks that,
and ``moe_fuse.kernels`` imports triton only at its first call.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from .. import config


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b). ``triton.cdiv`` is a constexpr function whose call costs microseconds of
    argument unwrapping; the launchers call this a dozen times per layer."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Host-side smallest power of two >= n (1 for n <= 1); see ``cdiv`` for why not triton's."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (read now, not at import)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def interpreter_usable() -> bool:
    """TRITON_INTERPRET is set now and was set when triton.language was imported."""
    if not interpreting():
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


# ``config.direct_launch`` off: every compiled launch goes through triton's ``JITFunction.run``. The direct path
# reads triton's internals (the binder in ``device_caches``, the launcher's argument order), so it is taken only
# on the triton minor version it was checked on (tests/gpu checks it); others go through run.
DIRECT_LAUNCH_TRITON = "3.6"
_TRITON_MINOR = ".".join(triton.__version__.split(".")[:2])


class lazy_jit:
    """``kernel[grid](...)`` like a ``triton.jit`` function, jitted on first use per interpreter setting.

    Compiled launches of a specialization seen before skip most of ``JITFunction.run``: on the H200
    hosts it costs ~17-19 us of Python per launch of a 20-argument kernel on top of 8-11 us for the
    launcher itself (bench/results/probe_launch_args_2026-12-02*.log), and the 30B layer step at
    T=4096, ~16 of our launches for ~2.5 ms of GPU work, is host-bound. The specialization is
    triton's own: its binder, the one ``run`` calls, gives the key (so no rule of triton's is copied
    here); what is skipped is the rest (string cache key, launch metadata, empty hook chains, device
    lookups). A key's first launch, a launch with profiler hooks, and a callable grid go through
    ``run`` as before.
    """

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._by_mode = {}
        self._compiled = {}  # (device, specialization, options) -> triton's CompiledKernel

    def _get(self):
        mode = interpreting()
        kernel = self._by_mode.get(mode)
        if kernel is None:
            # triton.jit reads TRITON_INTERPRET from os.environ right now.
            kernel = self._by_mode[mode] = triton.jit(self.fn)
        return kernel

    def __getitem__(self, grid):
        if not config.direct_launch or _TRITON_MINOR != DIRECT_LAUNCH_TRITON or interpreting():
            return self._get()[grid]
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs):
        kernel = self._by_mode.get(False) or self._get()
        knobs = triton.knobs
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        get_device = getattr(torch._C, "_cuda_getDevice", None)
        if callable(grid) or enter.calls or leave.calls or kernel.pre_run_hooks or get_device is None:
            return kernel[grid](*args, **kwargs)
        device = get_device()  # triton's driver: torch.cuda.current_device(), without its lazy-init check
        caches = kernel.device_caches.get(device)  # (kernel_cache, key_cache, target, backend, binder)
        if caches is None:  # this device's first launch creates them
            return kernel[grid](*args, **kwargs)
        # The options exactly as JITFunction.run completes them before binding.
        kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound, specialization, options = caches[-1](*args, **kwargs)
        key = (device, tuple(specialization), tuple(options.items()))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = kernel[grid](*args, **kwargs)  # compiles or finds it, and launches
            if compiled is not None:
                self._compiled[key] = compiled
            return compiled
        n = len(grid)
        compiled.run(
            grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, torch._C._cuda_getCurrentRawStream(device),
            compiled.function, compiled.packed_metadata, None, None, None, *bound.values(),
        )
        return compiled
