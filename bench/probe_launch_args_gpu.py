#!/usr/bin/env python3
"""Host cost of one Triton launch by the number and kind of its arguments (H200 hosts).

    PYTHONPATH=. python3 bench/probe_launch_args_gpu.py

Why: the 30B layer step at T=4096 is host-bound, and our launches cost 20-40 us of host time each
against ~16 for a two-argument no-op (bench/results/host_cprofile_t4096_2026-12-01.log). Triton's
launcher calls cuPointerGetAttribute for every tensor argument and the binder specializes every
argument, so the cost may grow with the argument count. Each line: microseconds per launch, issued
back to back (the kernel is one tiny program, so the GPU keeps up), best of five rounds.
"""

import time

import torch
import triton
import triton.language as tl


@triton.jit
def _k2(p0, n, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.store(p0 + i, tl.load(p0 + i, mask=i < n), mask=i < n)


@triton.jit
def _k8p(p0, p1, p2, p3, p4, p5, p6, p7, n, B: tl.constexpr):
    i = tl.arange(0, B)
    m = i < n
    v = tl.load(p1 + i, mask=m) + tl.load(p2 + i, mask=m) + tl.load(p3 + i, mask=m) + tl.load(p4 + i, mask=m)
    v += tl.load(p5 + i, mask=m) + tl.load(p6 + i, mask=m) + tl.load(p7 + i, mask=m)
    tl.store(p0 + i, v, mask=m)


@triton.jit
def _k1p8i(p0, n0, n1, n2, n3, n4, n5, n6, n7, B: tl.constexpr):
    i = tl.arange(0, B)
    m = i < (n0 + n1 + n2 + n3 + n4 + n5 + n6 + n7)
    tl.store(p0 + i, tl.load(p0 + i, mask=m), mask=m)


@triton.jit
def _k8p8i(p0, p1, p2, p3, p4, p5, p6, p7, n0, n1, n2, n3, n4, n5, n6, n7, B: tl.constexpr, C0: tl.constexpr,
           C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr):
    i = tl.arange(0, B)
    m = i < (n0 + n1 + n2 + n3 + n4 + n5 + n6 + n7 + C0 + C1 + C2 + C3)
    v = tl.load(p1 + i, mask=m) + tl.load(p2 + i, mask=m) + tl.load(p3 + i, mask=m) + tl.load(p4 + i, mask=m)
    v += tl.load(p5 + i, mask=m) + tl.load(p6 + i, mask=m) + tl.load(p7 + i, mask=m)
    tl.store(p0 + i, v, mask=m)


def per_call_us(fn, reps=2000, rounds=5):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) * 1e6 / reps)
        torch.cuda.synchronize()
    return best


def main():
    dev = "cuda"
    ts = [torch.zeros(1024, device=dev) for _ in range(8)]
    a, b = torch.randn(256, 2048, device=dev, dtype=torch.bfloat16), torch.randn(8, 2048, 768, device=dev,
                                                                               dtype=torch.bfloat16)
    offs = torch.arange(32, 257, 32, device=dev, dtype=torch.int32)
    big = torch.empty(1 << 20, device=dev, dtype=torch.int32)
    compiled = _k8p8i[(1,)](*ts, *range(8), B=1024, C0=0, C1=0, C2=0, C3=0)
    stream = torch.cuda.current_stream().cuda_stream
    run, fn, meta = compiled.run, compiled.function, compiled.packed_metadata
    from triton import knobs

    def direct():  # the C launcher alone: no binder, no cache key, no launch metadata
        run(1, 1, 1, stream, fn, meta, None, knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook,
            *ts, 0, 1, 2, 3, 4, 5, 6, 7, 1024, 0, 0, 0, 0)

    ptrs = [t.data_ptr() for t in ts]

    def direct_int_ptrs():  # the same with the pointers as Python ints: no cuPointerGetAttribute per tensor
        run(1, 1, 1, stream, fn, meta, None, knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook,
            *ptrs, 0, 1, 2, 3, 4, 5, 6, 7, 1024, 0, 0, 0, 0)

    cases = {
        "1 ptr + 1 int": lambda: _k2[(1,)](ts[0], 1024, B=1024),
        "8 ptrs + 1 int": lambda: _k8p[(1,)](*ts, 1024, B=1024),
        "1 ptr + 8 ints": lambda: _k1p8i[(1,)](ts[0], *range(8), B=1024),
        "8 ptrs + 8 ints + 4 constexpr": lambda: _k8p8i[(1,)](*ts, *range(8), B=1024, C0=0, C1=0, C2=0, C3=0),
        "  same, compiled.run directly": direct,
        "  same, run with int pointers": direct_int_ptrs,
        "torch.empty [S, H] bf16": lambda: torch.empty(32768, 2048, device=dev, dtype=torch.bfloat16),
        "5 slices of one tensor": lambda: (big[:100], big[100:200], big[200:300], big[300:400], big[400:]),
        "t.data_ptr() x8": lambda: [t.data_ptr() for t in ts],
        "torch._grouped_mm (8 groups, tiny)": lambda: torch._grouped_mm(a, b, offs=offs),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
    }
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    for name, f in cases.items():
        print(f"  {name:40s} {per_call_us(f):7.2f} us")


def parts():
    """The pieces of ``JITFunction.run`` for the 20-argument kernel, each timed alone."""
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import compute_cache_key

    ts = [torch.zeros(1024, device="cuda") for _ in range(8)]
    args = (*ts, *range(8))
    kw = dict(B=1024, C0=0, C1=0, C2=0, C3=0)
    compiled = _k8p8i[(1,)](*args, **kw)
    dev = driver.active.get_current_device()
    kernel_cache, key_cache, target, backend, binder = _k8p8i.device_caches[dev]
    kw2 = dict(kw, debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode)
    bound, spec, opts = binder(*args, **kw2)
    stream = driver.active.get_current_stream(dev)
    vals = tuple(bound.values())
    key = (tuple(spec), tuple(opts.items()))
    memo = {key: compiled}
    cases = {
        "driver get_current_device": lambda: driver.active.get_current_device(),
        "driver get_current_stream": lambda: driver.active.get_current_stream(dev),
        "torch._C._cuda_getDevice": lambda: torch._C._cuda_getDevice(),
        "binder (20 args)": lambda: binder(*args, **kw2),
        "compute_cache_key": lambda: compute_cache_key(key_cache, spec, opts),
        "tuple key + dict get": lambda: memo.get((tuple(spec), tuple(opts.items()))),
        "launch_metadata": lambda: compiled.launch_metadata((1,), stream, *vals),
        "bound.values() tuple": lambda: tuple(bound.values()),
    }
    for name, f in cases.items():
        print(f"  {name:40s} {per_call_us(f):7.2f} us")


if __name__ == "__main__":
    main()
    parts()
