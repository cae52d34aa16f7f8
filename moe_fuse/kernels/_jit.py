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

import os

import torch
import triton


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


# Off: every launch goes through triton's own ``JITFunction.run`` (binder, cache key, launcher).
FAST_LAUNCH = True

_I32 = range(-(2**31), 2**31)
_I64 = range(-(2**63), 2**63)


def arg_key(arg):
    """A hashable key of a runtime (non-constexpr) argument, at least as fine as triton's specialization.

    triton 3.6 specializes a tensor on its dtype and 16-byte alignment, an int on its type (i32, i64 or
    u64 by range), on being 1 (then a constant) and on divisibility by 16, a tensor descriptor on its
    dtype and block shape; floats and bools on their type only. Two arguments with one key get one
    compiled kernel (tests/test_jit_launch.py checks this against triton's own specializer).
    """
    if isinstance(arg, bool):
        return bool
    if isinstance(arg, int):
        return (int, arg == 1, arg % 16 == 0, arg in _I32, arg in _I64)
    if arg is None:
        return None
    if isinstance(arg, float):
        return float
    data_ptr = getattr(arg, "data_ptr", None)
    if data_ptr is not None:
        return (arg.dtype, data_ptr() % 16 == 0)
    base = getattr(arg, "base", None)  # a TensorDescriptor
    if base is not None and hasattr(arg, "block_shape"):
        return ("desc", base.dtype, tuple(arg.block_shape), arg.padding)
    raise TypeError(f"no launch key for {type(arg).__name__}")


class _Fast:
    """What a direct launch of one specialization needs: the compiled kernel and where the arguments go."""

    __slots__ = ("compiled", "tail")

    def __init__(self, compiled, tail):
        self.compiled = compiled
        self.tail = tail  # (name, default) of the parameters after the positional ones, in order


class lazy_jit:
    """``kernel[grid](...)`` like a ``triton.jit`` function, jitted on first use per interpreter setting.

    Compiled (not interpreted) launches skip most of ``JITFunction.run`` after a specialization's first
    call: that path costs ~15-50 us of host time per launch (the binder, a string cache key, launch
    metadata), and the 30B layer step at T=4096 issues ~25 launches for ~2.5 ms of GPU work, so the host
    sets its pace (bench/KERNELS_NOTES.md). The first call of each key goes through triton, which
    compiles and launches; later ones call the compiled kernel's launcher with the same arguments.
    """

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._by_mode = {}
        self._fast = {}
        self._constexpr = None  # per parameter: is it a constexpr (its value is part of the key)

    def _get(self):
        mode = interpreting()
        kernel = self._by_mode.get(mode)
        if kernel is None:
            # triton.jit reads TRITON_INTERPRET from os.environ right now.
            kernel = self._by_mode[mode] = triton.jit(self.fn)
        return kernel

    def __getitem__(self, grid):
        if not FAST_LAUNCH or interpreting():
            return self._get()[grid]
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _key(self, device, args, kwargs):
        kernel = self._get()
        if self._constexpr is None:
            self._constexpr = {p.name: p.is_constexpr for p in kernel.params}
            self._names = kernel.arg_names
        flags, names = self._constexpr, self._names
        # constexprs and options (num_warps, ...) by value and type (1 and 1.0 compile differently)
        key = [(type(arg), arg) if flags[names[i]] else arg_key(arg) for i, arg in enumerate(args)]
        for name, value in kwargs.items():
            key.append((name, type(value), value) if flags.get(name, True) else (name, arg_key(value)))
        knobs = triton.knobs
        key.append((device, knobs.runtime.debug, knobs.compilation.instrumentation_mode))
        return tuple(key)

    def _launch(self, grid, args, kwargs):
        knobs = triton.knobs
        if knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls or callable(grid):
            return self._get()[grid](*args, **kwargs)  # a profiler's hooks get what triton gives them
        device = torch.cuda.current_device()
        try:
            key = self._key(device, args, kwargs)
            fast = self._fast.get(key)
        except TypeError:  # an unhashable constexpr, or an argument of a kind arg_key does not know
            return self._get()[grid](*args, **kwargs)
        if fast is None:
            kernel = self._get()
            compiled = kernel[grid](*args, **kwargs)
            tail = tuple((p.name, p.default) for p in kernel.params[len(args):])
            self._fast[key] = _Fast(compiled, tail)
            return compiled
        compiled = fast.compiled
        values = list(args)
        for name, default in fast.tail:
            values.append(kwargs[name] if name in kwargs else default)
        stream = torch._C._cuda_getCurrentRawStream(device)  # what triton's driver asks torch for
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)
        return compiled
