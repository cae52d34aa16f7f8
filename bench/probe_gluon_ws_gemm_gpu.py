#!/usr/bin/env python3
"""Probe: does a warp-specialized Gluon GEMM run on the H200 with triton 3.6, and how fast?

    PYTHONPATH=. python3 bench/probe_gluon_ws_gemm_gpu.py [--shapes 16384x1536x2048,8192x8192x4096]
    python3 bench/probe_gluon_ws_gemm_gpu.py --compile-only      # CPU: compile for sm90, no GPU

Context (bench/KERNELS_NOTES.md): ``tl.range(warp_specialize=True)`` compiles on sm90 but every such
kernel hung on the H200, so fused SwiGLU / dSwiGLU epilogues at CUTLASS speed were out of reach.
Gluon (``triton.experimental.gluon``) states the partitions explicitly instead: here one loader warp
issues the TMA loads of A and B into a ring of shared-memory stages, and the default partition (8
warps, two warpgroups) waits on each stage's mbarrier, runs the async warpgroup MMA and releases the
stage once the next MMA is issued. One 128x256 tile per program, C = A @ B^T in bf16 with fp32
accumulation. Each shape runs in a subprocess with a timeout (a hang costs the timeout, not the
call); printed: max error against torch, and TFLOP/s beside torch.mm (cuBLAS).

Gluon has no interpreter (TRITON_INTERPRET does not run it), so nothing here can be tested on CPU
beyond compiling.
"""

import argparse
import subprocess
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_M, BLOCK_N, BLOCK_K, STAGES, WARPS = 128, 256, 64, 3, 8


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, K, BLOCK_K: gl.constexpr,
            STAGES: gl.constexpr):
    for i in range(gl.cdiv(K, BLOCK_K)):
        s = i % STAGES
        # A stage starts free: waiting for the phase before the first completes at once.
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, i * BLOCK_K], ready.index(s), a_bufs.index(s))
        tma.async_copy_global_to_shared(b_desc, [off_n, i * BLOCK_K], ready.index(s), b_bufs.index(s))


@gluon.jit
def _mma_and_store(a_bufs, b_bufs, ready, empty, c_ptr, off_m, off_n, K, stride_cm, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr):
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
    n_k = gl.cdiv(K, BLOCK_K)
    for i in range(n_k):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
        # One MMA in flight: the one before it is done, so its stage goes back to the loader.
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    gl.store(c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :], acc.to(gl.bfloat16))


@gluon.jit
def ws_gemm_kernel(a_desc, b_desc, c_ptr, K, stride_cm, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_K: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    off_m = gl.program_id(0) * BLOCK_M
    off_n = gl.program_id(1) * BLOCK_N
    gl.warp_specialize([
        (_mma_and_store, (a_bufs, b_bufs, ready, empty, c_ptr, off_m, off_n, K, stride_cm, BLOCK_M, BLOCK_N, BLOCK_K,
                          STAGES, WARPS)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, K, BLOCK_K, STAGES)),
    ], [1], [24])


def descriptors(a, b):
    a_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    b_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
    return (TensorDescriptor.from_tensor(a, [BLOCK_M, BLOCK_K], a_layout),
            TensorDescriptor.from_tensor(b, [BLOCK_N, BLOCK_K], b_layout))


def ws_gemm(a, b):
    M, K = a.shape
    N = b.shape[0]
    assert M % BLOCK_M == 0 and N % BLOCK_N == 0 and K % BLOCK_K == 0
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    a_desc, b_desc = descriptors(a, b)
    # 8 + 4 warps (the loader's warpgroup): 168 registers a thread fit the 64K register file.
    ws_gemm_kernel[(M // BLOCK_M, N // BLOCK_N)](a_desc, b_desc, c, K, c.stride(0), BLOCK_M, BLOCK_N, BLOCK_K,
                                                 STAGES, WARPS, num_warps=WARPS, maxnreg=168)
    return c


def compile_only():
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    a, b = torch.empty(256, 128, dtype=torch.bfloat16), torch.empty(512, 128, dtype=torch.bfloat16)
    a_desc, b_desc = descriptors(a, b)
    sig = {"a_desc": mangle_type(a_desc), "b_desc": mangle_type(b_desc), "c_ptr": "*bf16", "K": "i32",
           "stride_cm": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
           "STAGES": "constexpr", "WARPS": "constexpr"}
    consts = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K, "STAGES": STAGES, "WARPS": WARPS}
    kernel = triton.compile(GluonASTSource(ws_gemm_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": WARPS, "maxnreg": 168})
    print(f"compiled for sm90: shared {kernel.metadata.shared} bytes, "
          f"{kernel.asm['ptx'].count('wgmma.mma_async')} wgmma.mma_async, "
          f"{kernel.asm['ptx'].count('setmaxnreg')} setmaxnreg")


def child(shape: str):
    M, N, K = (int(v) for v in shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) / K**0.5
    c = ws_gemm(a, b)
    torch.cuda.synchronize()
    want = a.float() @ b.float().t()
    err = ((c.float() - want).abs().max() / want.abs().max()).item()
    flops = 2 * M * N * K
    ms = triton.testing.do_bench(lambda: ws_gemm(a, b), warmup=25, rep=200, return_mode="median")
    ms_ref = triton.testing.do_bench(lambda: a @ b.t(), warmup=25, rep=200, return_mode="median")
    print(f"  {shape}: max rel err {err:.1e} | gluon WS {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s) | "
          f"torch.mm {ms_ref:.3f} ms ({flops / ms_ref / 1e9:.0f} TFLOP/s)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384x1536x2048,16384x2048x768,8192x8192x4096")
    ap.add_argument("--timeout", type=int, default=60)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--child", default="")
    args = ap.parse_args()
    if args.compile_only:
        return compile_only()
    if args.child:
        return child(args.child)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for shape in args.shapes.split(","):
        try:
            run = subprocess.run([sys.executable, __file__, "--child", shape], timeout=args.timeout,
                                 capture_output=True, text=True)
            out = (run.stdout + run.stderr).strip().splitlines()
            print("\n".join(out[-3:]) if run.returncode == 0 else f"  {shape}: failed rc {run.returncode}: "
                  + " | ".join(out[-4:]), flush=True)
        except subprocess.TimeoutExpired:
            print(f"  {shape}: no result within {args.timeout} s (hung?)", flush=True)


if __name__ == "__main__":
    main()
