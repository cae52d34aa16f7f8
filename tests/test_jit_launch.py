"""The direct-launch key of kernels/_jit.py against triton's own specializer.

A compiled launch reuses the kernel compiled for the first call with the same ``arg_key``s, so two
arguments with one key must specialize the same in triton (else a kernel compiled for, say, an
aligned pointer or a multiple of 16 would run on an argument that is not). The launch itself needs a
GPU: bench/check_fast_launch_gpu.py runs every kernel both ways and compares the bits.
"""

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.tools.tensor_descriptor import TensorDescriptor

from moe_fuse.kernels import _jit


def triton_spec(arg):
    return native_specialize_impl(BaseBackend, arg, False, True, True)


def assert_key_refines_spec(values):
    """No launch key may cover two triton specializations."""
    seen = {}
    for v in values:
        key, spec = _jit.arg_key(v), triton_spec(v)
        if key in seen:
            assert seen[key][1] == spec, f"{seen[key][0]!r} and {v!r} share key {key} but specialize {seen[key][1]} / {spec}"
        else:
            seen[key] = (v, spec)
    return seen


def test_int_keys_refine_triton_specialization():
    edges = [0, 1, 2, 15, 16, 17, 32, 48, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**32,
             2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 16, 2**64 - 1]
    values = edges + [-v for v in edges] + list(range(-40, 200)) + [-(2**31), -(2**31) - 1, -(2**63)]
    values = [v for v in values if -(2**63) <= v < 2**64]  # triton takes no others
    seen = assert_key_refines_spec(values)
    # the key is not trivially fine: many ints share one
    assert len(seen) < len(set(values)) / 4


def test_tensor_scalar_and_descriptor_keys_refine_triton_specialization():
    values = [None, True, False, 0.5, 1.0, -3.0]
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64):
        base = torch.empty(4096, dtype=dtype)
        values += [base, base[1:], base[8:], base[16:], base[64:]]  # aligned and not, by element size
    x = torch.empty(256, 64, dtype=torch.bfloat16)
    values += [TensorDescriptor.from_tensor(x, [16, 32]), TensorDescriptor.from_tensor(x[16:], [16, 32]),
               TensorDescriptor.from_tensor(x, [32, 32]), TensorDescriptor.from_tensor(x.float(), [16, 32])]
    seen = assert_key_refines_spec(values)
    aligned, offset = torch.empty(64, dtype=torch.float32), torch.empty(64, dtype=torch.float32)[1:]
    assert _jit.arg_key(aligned) != _jit.arg_key(offset)
    assert len(seen) < len(values)


def test_unknown_argument_kind_has_no_key():
    with pytest.raises(TypeError, match="no launch key for str"):
        _jit.arg_key("x")


def test_interpreter_launches_go_through_triton(monkeypatch):
    """Under TRITON_INTERPRET=1 ``kernel[grid]`` is triton's own launcher (no direct path, no key cache)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from moe_fuse.kernels.permute import _expand_rows_kernel

    launcher = _expand_rows_kernel[(1,)]
    assert not getattr(launcher, "__qualname__", "").startswith("lazy_jit")
    assert _expand_rows_kernel._fast == {}


class _Param:
    def __init__(self, name, constexpr=False, default=None):
        self.name, self.is_constexpr, self.default = name, constexpr, default


class _FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.launches = []

    def run(self, g0, g1, g2, stream, function, packed, metadata, enter, exit_, *args):
        self.launches.append(((g0, g1, g2), stream, args))


class _FakeKernel:
    """Stands in for a triton JITFunction: records the calls that go through triton's own path."""

    def __init__(self):
        self.params = [_Param("x_ptr"), _Param("n"), _Param("BLOCK", True), _Param("FLAG", True, default=False)]
        self.arg_names = [p.name for p in self.params]
        self.compiled, self.slow_calls = [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.slow_calls.append((grid, args, kwargs))
            self.compiled.append(_FakeCompiled())
            return self.compiled[-1]

        return launch


def test_direct_launch_reuses_one_compiled_kernel_per_key(monkeypatch):
    """Argument order, defaults, options and the key cache of the direct path, without a GPU."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    kernel = _jit.lazy_jit(lambda x_ptr, n, BLOCK, FLAG=False: None)
    fake = _FakeKernel()
    monkeypatch.setattr(kernel, "_get", lambda: fake)
    a = torch.empty(64)
    kernel[(3,)](a, 32, BLOCK=64, num_warps=4)  # first of its key: through triton
    kernel[(5, 2)](a, 48, BLOCK=64, num_warps=4)  # same key (both multiples of 16): direct
    kernel[(1,)](a, 33, BLOCK=64, num_warps=4)  # 33 is no multiple of 16: a new key, through triton
    kernel[(1,)](a, 32, BLOCK=128, num_warps=4)  # another constexpr value: a new key
    kernel[(1,)](a, 32, BLOCK=64, num_warps=8)  # another option: a new key
    kernel[(2,)](a[1:], 32, BLOCK=64, num_warps=4)  # a pointer off 16 bytes: a new key
    kernel[(7,)](a, 64, BLOCK=64, FLAG=True, num_warps=4)  # a constexpr passed: a new key
    kernel[(7,)](a, 80, BLOCK=64, FLAG=True, num_warps=4)  # ... reused
    assert [c[1][1] for c in fake.slow_calls] == [32, 33, 32, 32, 32, 64]
    first, flagged = fake.compiled[0], fake.compiled[-1]
    # every parameter in signature order, the default of FLAG filled in, no options
    assert first.launches == [((5, 2, 1), 1234, (a, 48, 64, False))]
    assert flagged.launches == [((7, 1, 1), 1234, (a, 80, 64, True))]
    assert all(not c.launches for c in fake.compiled[1:-1])

    monkeypatch.setattr(_jit, "FAST_LAUNCH", False)  # off: every call through triton
    kernel[(5,)](a, 48, BLOCK=64, num_warps=4)
    assert len(fake.slow_calls) == 7 and len(first.launches) == 1
