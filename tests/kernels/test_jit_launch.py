"""lazy_jit's direct launch (kernels/_jit.py): which launches go through triton's JITFunction.run, and
what a direct one passes to the compiled kernel's launcher.

Compiled kernels need a GPU, so a stand-in for the JITFunction plays triton's part here: its binder
has triton's contract (bound arguments, specialization, options) and its launcher records calls.
bench/check_direct_launch_gpu.py runs the real thing on the H200 (same bits, host time per launch).
"""

import pytest
import torch
import triton

from moe_fuse import config  # noqa: E402
from moe_fuse.kernels import _jit


class FakeCompiled:
    function = "cu-function"
    packed_metadata = ("meta",)

    def __init__(self):
        self.runs = []

    @property
    def run(self):
        return lambda *a: self.runs.append(a)


class FakeJIT:
    """A JITFunction for ``fn(x_ptr, n, BLOCK: constexpr)``; specializes x_ptr on 16-byte alignment."""

    debug = False

    def __init__(self):
        self.pre_run_hooks = []
        self.device_caches = {0: (None, None, None, None, self.binder)}
        self.compiled = {}  # specialization -> FakeCompiled
        self.jit_calls = []

    @staticmethod
    def binder(x_ptr, n, BLOCK, **options):
        spec = [("*fp32", "D" if x_ptr % 16 == 0 else None), ("i32", None), ("constexpr", BLOCK)]
        return {"x_ptr": x_ptr, "n": n, "BLOCK": BLOCK}, spec, options

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            _, spec, _ = self.binder(*args, **kwargs)
            return self.compiled.setdefault(repr(spec), FakeCompiled())

        return launch


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(_jit, "interpreting", lambda: False)
    monkeypatch.setattr(config, "direct_launch", True)
    monkeypatch.setattr(_jit, "_TRITON_MINOR", _jit.DIRECT_LAUNCH_TRITON)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    k = _jit.lazy_jit(lambda x_ptr, n, BLOCK: None)
    fake = FakeJIT()
    k._by_mode[False] = fake
    return k, fake


def test_first_launch_of_a_key_goes_through_triton_then_the_launcher_directly(kernel):
    k, fake = kernel
    first = k[(3,)](64, 10, BLOCK=32)
    assert len(fake.jit_calls) == 1 and first.runs == []
    second = k[(5, 2)](128, 11, BLOCK=32)  # same specialization: 16-aligned pointer, same BLOCK
    assert second is first and len(fake.jit_calls) == 1
    # grid padded to 3D, the current stream, then every bound argument (constexprs included), as JITFunction.run
    assert first.runs == [(5, 2, 1, 1234, "cu-function", ("meta",), None, None, None, 128, 11, 32)]


def test_another_specialization_goes_through_triton_again(kernel):
    k, fake = kernel
    k[(1,)](64, 10, BLOCK=32)
    k[(1,)](68, 10, BLOCK=32)  # pointer not 16-byte aligned
    k[(1,)](64, 10, BLOCK=64)  # another constexpr
    k[(1,)](64, 10, BLOCK=32, num_warps=8)  # another option
    assert len(fake.jit_calls) == 4
    k[(1,)](80, 12, BLOCK=64)
    assert len(fake.jit_calls) == 4  # a key seen before


def test_options_are_completed_as_triton_does_before_binding(kernel, monkeypatch):
    k, fake = kernel
    k[(1,)](64, 10, BLOCK=32)
    assert fake.jit_calls[0][2]["debug"] is False
    assert fake.jit_calls[0][2]["instrumentation_mode"] == triton.knobs.compilation.instrumentation_mode
    monkeypatch.setattr(triton.knobs.runtime, "debug", True)
    k[(1,)](64, 10, BLOCK=32)  # debug on: another compiled kernel, through triton
    assert len(fake.jit_calls) == 2 and fake.jit_calls[1][2]["debug"] is True


@pytest.mark.parametrize(
    "why", ["switch off", "other triton", "profiler hook", "callable grid", "pre-run hook", "new device"]
)
def test_these_launches_always_go_through_triton(kernel, monkeypatch, why):
    k, fake = kernel
    k[(1,)](64, 10, BLOCK=32)
    grid = (1,)
    if why == "switch off":
        monkeypatch.setattr(config, "direct_launch", False)
    elif why == "other triton":
        monkeypatch.setattr(_jit, "_TRITON_MINOR", "3.7")
    elif why == "profiler hook":
        monkeypatch.setattr(triton.knobs.runtime.launch_enter_hook, "calls", [lambda metadata: None])
    elif why == "callable grid":
        grid = lambda meta: (1,)  # noqa: E731
    elif why == "pre-run hook":
        fake.pre_run_hooks.append(lambda *a, **k: None)
    else:
        monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1)  # no device_caches for device 1 yet
    k[grid](64, 10, BLOCK=32)
    assert len(fake.jit_calls) == 2
    assert all(c.runs == [] for c in fake.compiled.values())


def test_the_interpreter_never_takes_the_direct_path(monkeypatch):
    monkeypatch.setattr(_jit, "interpreting", lambda: True)
    k = _jit.lazy_jit(lambda x_ptr, n, BLOCK: None)
    fake = FakeJIT()
    k._by_mode[True] = fake
    k[(1,)](64, 10, BLOCK=32)
    k[(1,)](64, 10, BLOCK=32)
    assert len(fake.jit_calls) == 2
