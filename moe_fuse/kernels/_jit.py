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


class lazy_jit:
    """``kernel[grid](...)`` like a ``triton.jit`` function, jitted on first use per interpreter setting."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._by_mode = {}

    def _get(self):
        mode = interpreting()
        kernel = self._by_mode.get(mode)
        if kernel is None:
            # triton.jit reads TRITON_INTERPRET from os.environ right now.
            kernel = self._by_mode[mode] = triton.jit(self.fn)
        return kernel

    def __getitem__(self, grid):
        return self._get()[grid]
