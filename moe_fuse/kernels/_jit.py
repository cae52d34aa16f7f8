"""Launch-time choice between the Triton compiler and the Triton interpreter.

``@triton.jit`` decides at decoration time (module import) whether a kernel is
compiled or interpreted, from ``TRITON_INTERPRET``. A test that sets the
variable after some other module imported this package would then get
compiled kernels on CPU tensors. ``lazy_jit`` defers that decision to the
first launch under each setting, so the flag is read at call time.

Device functions shared by kernels are ``jit_helper``s, never ``@triton.jit``
functions: a ``@triton.jit`` helper would be fixed at import time and could
disagree with its caller. When ``lazy_jit`` jits a kernel for one setting, it
jits it from a copy of the kernel's function whose globals map each helper's
name to that helper jitted for the same setting (and so on for helpers that
call helpers). The rules that come with it:

- a kernel or helper names a helper by a module global (``from .jit_math import
  glu``), not an attribute (``jit_math.glu``) nor a closure variable;
- that copy of the globals is taken at the first launch under each setting:
  what the function reads from its module is what the module held then (the
  kernels read ``tl`` and helpers only);
- a helper returns its values at its end (no early return inside it); a kernel
  that exits early tests what a helper returned.

Triton inlines device functions, so a kernel calling a helper computes what it
would with the helper's body pasted in, bit for bit. The instructions come in
the order of the calls and their arguments, and ptxas' schedule follows that
order: a kernel keeps its steps in the order they had (jit_math.py says how
for the backward passes), and then compiles to the same machine code.

Triton's own library functions (``tl.sum``, ``tl.cumsum``, ``tl.sigmoid``) are
jitted when ``triton.language`` is first imported, so the interpreter works
only if TRITON_INTERPRET was set by then: ``interpreter_usable`` checks that,
and ``moe_fuse.kernels`` imports triton only at its first call.
"""

from __future__ import annotations

import functools
import os
import types

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
    """``kernel[grid](...)`` like a ``triton.jit`` function, jitted on first use per interpreter setting, with
    the ``jit_helper``s it calls jitted for the same setting.

    Compiled launches of a specialization seen before skip most of ``JITFunction.run``: on the H200
    hosts it costs ~17-19 us of Python per launch of a 20-argument kernel on top of 8-11 us for the
    launcher itself (the launch-argument probe at da3be06), and the 30B layer step at
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
            kernel = self._by_mode[mode] = _jit(self.fn, mode)
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


class jit_helper:
    """A Triton device function for ``lazy_jit`` kernels and other helpers to call: jitted per interpreter
    setting, each time with the kernel that calls it (see the module docstring)."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__qualname__ = fn.__qualname__
        self.__doc__ = fn.__doc__
        self.__module__ = fn.__module__
        self._by_mode = {}

    def jitted(self, interpret: bool):
        """The helper as a device function of kernels jitted for the interpreter (True) or the compiler."""
        fn = self._by_mode.get(interpret)
        if fn is None:
            fn = _jit(self.fn, interpret, self._by_mode)
        return fn

    def __call__(self, *args, **kwargs):
        raise TypeError(f"{self!r} runs inside a Triton kernel only")

    def __repr__(self):
        return f"<jit_helper {self.__module__}.{self.__qualname__} (import it by name into the calling module)>"


def _helper_names(fn) -> list[str]:
    """The globals of fn that are jit_helpers and that its code may read."""
    names = set()
    codes = [fn.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return sorted(n for n in names if isinstance(fn.__globals__.get(n), jit_helper))


def _jit(fn, interpret: bool, cache: dict | None = None):
    """fn jitted for the interpreter or the compiler, with its helpers jitted the same way.

    A function that calls no helper is jitted as it is. Otherwise a copy of it is: same code, same source
    for triton (cache key, interpreter rewrite), and globals that are a copy of its module's with each
    helper's name bound to the helper's jitted function. ``cache`` (a helper's per-setting cache) gets
    the result before the helpers are bound, so a helper that reaches itself again finds it.
    """
    names = _helper_names(fn)
    scope = fn.__globals__
    if names:
        scope = dict(scope)
        copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        copy.__qualname__ = fn.__qualname__
        copy.__doc__ = fn.__doc__
        copy.__annotations__ = fn.__annotations__
        fn = copy
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        jitted = InterpretedFunction(fn)
    else:
        jitted = triton.runtime.JITFunction(fn)
    if cache is not None:
        cache[interpret] = jitted
    for name in names:
        scope[name] = scope[name].jitted(interpret)
    return jitted
