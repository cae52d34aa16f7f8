#!/usr/bin/env python3
"""Probe: do the bandwidth-bound passes spend fewer joules per byte when TMA moves their tiles?

    PYTHONPATH=. python3 bench/probe_pass_tma_gpu.py [--case 30b:16384] [--seconds 2.5]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/probe_pass_tma_gpu.py --check   # CPU: bits only

At the 700 W cap a layer step takes about its energy / 700 W, and its six passes move ~4.4 GB at
0.133-0.168 J/GB (probe_glue_energy_gpu.py), ~0.7 J of the ~5.5 J step. A plain copy at 4.1 TB/s
draws ~550 W; HBM itself should take well under half of that, so most of a pass's joules are spent
on the chip: load/store instructions, address math, registers. TMA moves a tile with one instruction
per box. If that cuts the on-chip part, SwiGLU and dSwiGLU (rectangular tiles of sorted rows) could
be rewritten that way. Each variant runs back to back for --seconds (NVML energy per call), alone and
behind the CUTLASS gate_up GEMM (the pass then runs at the clock the cap leaves it, as in the step).
The TMA variants are checked bitwise against the pointer ones first.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402


@triton.jit
def _copy_ptr(src, dst, R, C, BR: tl.constexpr, BC: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    r64 = r.to(tl.int64)[:, None]
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        m = (r < R)[:, None] & (c < C)[None, :]
        tl.store(dst + r64 * C + c[None, :], tl.load(src + r64 * C + c[None, :], mask=m), mask=m)


@triton.jit
def _copy_tma(src_desc, dst_desc, C, BR: tl.constexpr, BC: tl.constexpr):
    r0 = tl.program_id(0) * BR
    for c0 in range(0, C, BC):
        dst_desc.store([r0, c0], src_desc.load([r0, c0]))


@triton.jit
def _copy_tma_persistent(src_desc, dst_desc, R, C, BR: tl.constexpr, BC: tl.constexpr, STAGES: tl.constexpr):
    n_c = tl.cdiv(C, BC)
    n = tl.cdiv(R, BR) * n_c
    for t in tl.range(tl.program_id(0), n, tl.num_programs(0), num_stages=STAGES):
        r0 = (t // n_c) * BR
        c0 = (t % n_c) * BC
        dst_desc.store([r0, c0], src_desc.load([r0, c0]))


@triton.jit
def _swiglu_ptr(h, rw, order, a, S, I, BR: tl.constexpr, BC: tl.constexpr):
    """The product's plain SwiGLU pass (grouped_mm_path._swiglu_kernel without its switches)."""
    p = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = p < S
    w = tl.load(rw + tl.load(order + p, mask=ok, other=0), mask=ok, other=0.0).to(tl.float32)[:, None]
    p64 = p.to(tl.int64)[:, None]
    for i0 in range(0, I, BC):
        i = i0 + tl.arange(0, BC)
        m = ok[:, None] & (i < I)[None, :]
        gate = tl.load(h + p64 * (2 * I) + i[None, :], mask=m, other=0.0).to(tl.float32)
        up = tl.load(h + p64 * (2 * I) + I + i[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(a + p64 * I + i[None, :], (w * (gate * tl.sigmoid(gate) * up)).to(a.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_tma(h_desc, rw, order, a_desc, S, I, BR: tl.constexpr, BC: tl.constexpr):
    r0 = tl.program_id(0) * BR
    p = r0 + tl.arange(0, BR)
    ok = p < S
    w = tl.load(rw + tl.load(order + p, mask=ok, other=0), mask=ok, other=0.0).to(tl.float32)[:, None]
    for i0 in range(0, I, BC):
        gate = h_desc.load([r0, i0]).to(tl.float32)
        up = h_desc.load([r0, I + i0]).to(tl.float32)
        a_desc.store([r0, i0], (w * (gate * tl.sigmoid(gate) * up)).to(a_desc.dtype))


@triton.jit
def _swiglu_tma_persistent(h_desc, rw, order, a_desc, S, I, BR: tl.constexpr, BC: tl.constexpr,
                           STAGES: tl.constexpr):
    n_c = tl.cdiv(I, BC)
    n = tl.cdiv(S, BR) * n_c
    for t in tl.range(tl.program_id(0), n, tl.num_programs(0), num_stages=STAGES):
        r0 = (t // n_c) * BR
        i0 = (t % n_c) * BC
        p = r0 + tl.arange(0, BR)
        ok = p < S
        w = tl.load(rw + tl.load(order + p, mask=ok, other=0), mask=ok, other=0.0).to(tl.float32)[:, None]
        gate = h_desc.load([r0, i0]).to(tl.float32)
        up = h_desc.load([r0, I + i0]).to(tl.float32)
        a_desc.store([r0, i0], (w * (gate * tl.sigmoid(gate) * up)).to(a_desc.dtype))


def variants(h, rw, order, src, n_sm, interp):
    """label -> (fn, output tensor, bytes moved); the pointer and TMA variants of one pass share outputs' shapes."""
    S, two_i = h.shape
    I = two_i // 2
    R, C = src.shape
    out = {}

    def copy(kind, br, bc, warps, stages=3, progs=1):
        dst = torch.empty_like(src)
        if kind == "ptr":
            fn = lambda: _copy_ptr[(triton.cdiv(R, br),)](src, dst, R, C, BR=br, BC=bc, num_warps=warps)  # noqa: E731
        else:
            sd, dd = TensorDescriptor.from_tensor(src, [br, bc]), TensorDescriptor.from_tensor(dst, [br, bc])
            if kind == "tma":
                fn = lambda: _copy_tma[(triton.cdiv(R, br),)](sd, dd, C, BR=br, BC=bc, num_warps=warps)  # noqa: E731
            else:
                grid = (min(progs * n_sm, triton.cdiv(R, br) * triton.cdiv(C, bc)),)
                fn = lambda: _copy_tma_persistent[grid](sd, dd, R, C, BR=br, BC=bc, STAGES=stages,  # noqa: E731
                                                         num_warps=warps)
        out[f"copy {kind} {br}x{bc} w{warps}" + (f" s{stages} p{progs}" if kind == "persist" else "")] = (
            fn, dst, 2 * src.numel() * src.element_size(), "copy")

    def sw(kind, br, bc, warps, stages=3, progs=1):
        a = torch.empty(S, I, dtype=h.dtype, device=h.device)
        if kind == "ptr":
            fn = lambda: _swiglu_ptr[(triton.cdiv(S, br),)](h, rw, order, a, S, I, BR=br, BC=bc,  # noqa: E731
                                                             num_warps=warps)
        else:
            hd, ad = TensorDescriptor.from_tensor(h, [br, bc]), TensorDescriptor.from_tensor(a, [br, bc])
            if kind == "tma":
                fn = lambda: _swiglu_tma[(triton.cdiv(S, br),)](hd, rw, order, ad, S, I, BR=br, BC=bc,  # noqa: E731
                                                                 num_warps=warps)
            else:
                grid = (min(progs * n_sm, triton.cdiv(S, br) * triton.cdiv(I, bc)),)
                fn = lambda: _swiglu_tma_persistent[grid](hd, rw, order, ad, S, I, BR=br, BC=bc,  # noqa: E731
                                                           STAGES=stages, num_warps=warps)
        out[f"swiglu {kind} {br}x{bc} w{warps}" + (f" s{stages} p{progs}" if kind == "persist" else "")] = (
            fn, a, S * 3 * I * h.element_size(), "swiglu")

    if interp:
        copy("ptr", 4, 32, 4), copy("tma", 4, 32, 4), copy("persist", 4, 32, 4, 2)
        sw("ptr", 4, 32, 4), sw("tma", 4, 32, 4), sw("persist", 4, 32, 4, 2)
        return out
    copy("ptr", 4, 256, 4), copy("tma", 16, 256, 4), copy("tma", 32, 256, 4), copy("tma", 64, 128, 4)
    copy("persist", 32, 256, 4, 3, 1), copy("persist", 32, 256, 4, 4, 2), copy("persist", 64, 256, 8, 3, 1)
    sw("ptr", 4, 256, 4), sw("tma", 16, 256, 4), sw("tma", 32, 128, 4), sw("tma", 64, 128, 8)
    sw("persist", 32, 128, 4, 3, 2), sw("persist", 64, 128, 8, 3, 1), sw("persist", 32, 256, 8, 3, 1)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="30b:16384")
    ap.add_argument("--seconds", type=float, default=2.5)
    ap.add_argument("--check", action="store_true", help="bits only, small shapes (the CPU interpreter)")
    args = ap.parse_args()
    interp = args.check
    dev = torch.device("cpu" if interp else "cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    if interp:
        S, I, H = 96, 64, 64
    else:
        from check_kernels_gpu import PROBE_LAYERS
        layer, T = args.case.split(":")
        H, I, E, k = PROBE_LAYERS[layer]
        S = int(T) * k
    h = torch.randn(S, 2 * I, device=dev, dtype=torch.bfloat16, generator=gen)
    rw = torch.rand(S, device=dev, generator=gen).to(torch.bfloat16)
    order = torch.randperm(S, device=dev, generator=gen).to(torch.int32)
    src = torch.randn(S, H, device=dev, dtype=torch.bfloat16, generator=gen)
    n_sm = 4 if interp else torch.cuda.get_device_properties(dev).multi_processor_count
    vs = variants(h, rw, order, src, n_sm, interp)
    ref = {"copy": src, "swiglu": None}
    for label, (fn, o, _, family) in vs.items():
        o.fill_(float("nan"))  # poisoned: every element must be written
        fn()
        if ref[family] is None:
            ref[family] = o.clone()  # the first (pointer) variant of a pass is the reference
        same = torch.equal(o, ref[family])
        print(f"  {label:36s} bitwise equal to the pointer variant: {same}", flush=True)
        if not same:
            raise SystemExit(f"{label}: output differs")
    if interp:
        return

    from power import run_sustained

    wgu = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    counts = torch.full((E,), S // E, dtype=torch.int32, device=dev)
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    gemm = lambda: torch._grouped_mm(src, wgu.transpose(1, 2), offs=ends)  # noqa: E731
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{args.case}: S={S} I={I} H={H}", flush=True)

    def timed(label, fn, nbytes):
        ms, smp = run_sustained(fn, args.seconds, batch=20)
        mj = smp.mj_per_call or float("nan")
        per_gb = f"{mj / 1e3 / (nbytes / 1e9):6.3f} J/GB {nbytes / ms / 1e9:5.2f} TB/s" if nbytes else ""
        print(f"  {label:44s} {ms:7.3f} ms {mj:8.1f} mJ/call  {per_gb}\n      {smp.summary()}", flush=True)
        return ms, mj

    timed("torch copy_", lambda: vs[next(iter(vs))][1].copy_(src), 2 * src.numel() * 2)
    for label, (fn, _, nbytes, _) in vs.items():
        timed(label, fn, nbytes)
    g_ms, g_mj = timed("gate_up GEMM (CUTLASS) alone", gemm, 0)
    for label, (fn, _, nbytes, family) in vs.items():
        if family != "swiglu":
            continue
        ms, mj = timed(f"GEMM + {label}", lambda: (gemm(), fn()), 0)
        print(f"      the pass behind the GEMM: {ms - g_ms:.3f} ms, {mj - g_mj:.1f} mJ, "
              f"{(mj - g_mj) / 1e3 / (nbytes / 1e9):.3f} J/GB", flush=True)


if __name__ == "__main__":
    main()
