"""kernels/_jit.py: lazy_jit's direct launch (which launches go through triton's JITFunction.run, and what a
direct one passes to the compiled kernel's launcher), and jit_helper (device functions jitted with the kernel
that calls them, for the same interpreter setting).

Compiled kernels need a GPU, so a stand-in for the JITFunction plays triton's part in the launch tests: its
binder has triton's contract (bound arguments, specialization, options) and its launcher records calls.
bench/check_direct_launch_gpu.py runs the real thing on the H200 (same bits, host time per launch). The
helper tests run a kernel in the interpreter, and compile one for sm90 without launching it.
"""

import sys

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

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


# --------------------------------------------------------------------------- jit_helper


@_jit.jit_helper
def _square(x):
    return x * x


@_jit.jit_helper
def _square_plus(x, c):  # a helper calling a helper
    return _square(x) + c


def _helper_kernel(x_ptr, y_ptr, n, c, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    tl.store(y_ptr + i, _square_plus(tl.load(x_ptr + i, mask=mask), c), mask=mask)


def _bound(jitted, name):
    """What the name reads inside a kernel or helper jitted by lazy_jit."""
    return jitted.fn.__globals__[name]


def test_a_kernel_calls_helpers_in_the_interpreter_set_after_import(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    k = _jit.lazy_jit(_helper_kernel)  # decorating reads no setting and jits nothing
    assert k._by_mode == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not _jit.interpreter_usable():
        pytest.skip("triton.language was imported for the compiler (TRITON_INTERPRET unset then)")
    x = torch.randn(100)
    y = torch.zeros(100)
    k[(4,)](x, y, 100, 0.5, BLOCK=32)
    assert torch.equal(y, x * x + 0.5)
    kernel = k._by_mode[True]
    assert list(k._by_mode) == [True] and isinstance(kernel, InterpretedFunction)
    helper = _bound(kernel, "_square_plus")
    assert isinstance(helper, InterpretedFunction) and helper is _square_plus.jitted(True)
    assert isinstance(_bound(helper, "_square"), InterpretedFunction)
    # the module's own globals are left as they were
    assert sys.modules[__name__].__dict__["_square_plus"] is _square_plus


def test_the_compiled_kernel_calls_compiled_helpers(monkeypatch):
    monkeypatch.setattr(_jit, "interpreting", lambda: False)
    k = _jit.lazy_jit(_helper_kernel)
    kernel = k._get()
    assert isinstance(kernel, JITFunction) and kernel.fn.__code__ is _helper_kernel.__code__
    helper = _bound(kernel, "_square_plus")
    assert isinstance(helper, JITFunction) and helper is _square_plus.jitted(False)
    assert isinstance(_bound(helper, "_square"), JITFunction)
    assert _square_plus.jitted(True) is not helper  # one jitted function per setting
    # triton's source and cache key are the function's: the key walks the helpers (a jit_helper left in the
    # globals would fail here as an unsupported function)
    assert kernel.src.startswith("def _helper_kernel(") and helper.src.startswith("def _square_plus(")
    assert kernel.cache_key == _jit._jit(_helper_kernel, False).cache_key


def test_the_compiled_kernel_compiles_with_its_helpers_inlined(monkeypatch):
    """triton.compile for sm90 on the host: no GPU needed (ptxas ships with triton)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setattr(_jit, "interpreting", lambda: False)
    kernel = _jit.lazy_jit(_helper_kernel)._get()
    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "c": "fp32", "BLOCK": "constexpr"}
    try:
        compiled = triton.compile(ASTSource(kernel, sig, {(4,): 128}), target=GPUTarget("cuda", 90, 32))
    except RuntimeError as e:  # no CUDA backend or ptxas in this triton
        pytest.skip(f"cannot compile for sm90 here: {e}")
    ttir, ptx = compiled.asm["ttir"], compiled.asm["ptx"]
    assert "tt.call" not in ttir and "arith.mulf" in ttir and "arith.addf" in ttir
    assert ".entry _helper_kernel" in ptx and ".func" not in ptx and "call.uni" not in ptx


def test_every_kernel_binds_its_helpers_for_the_compiler():
    """Each lazy_jit kernel of moe_fuse.kernels, jitted for the compiler, reads every helper it names as a
    JITFunction (its cache key resolves all of them), and a kernel that names none is jitted as it is."""
    import importlib
    import pkgutil

    import moe_fuse.kernels as pkg

    seen = 0
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for value in vars(module).values():
            if not isinstance(value, _jit.lazy_jit) or value.fn.__module__ != module.__name__:
                continue
            kernel = _jit._jit(value.fn, False)
            names = _jit._helper_names(value.fn)
            if not names:
                assert kernel.fn is value.fn
            for name in names:
                assert isinstance(kernel.fn.__globals__[name], JITFunction), (value.__name__, name)
            assert kernel.cache_key
            seen += 1
    assert seen >= 20


def test_a_helper_runs_only_inside_a_kernel():
    with pytest.raises(TypeError, match="inside a Triton kernel"):
        _square(torch.ones(1))
