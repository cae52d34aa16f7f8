#!/usr/bin/env python3
"""Probe: a warp-specialized Triton row-ragged grouped GEMM against torch._grouped_mm (CUTLASS), sm90.

    PYTHONPATH=. python3 bench/probe_ws_gemm_gpu.py [--cases 30b:16384,30b:4096] [--dists exact,router]

triton 3.6 warp-specializes a loop marked ``tl.range(..., warp_specialize=True)`` on sm90 too (Meta's
AutoWS pass: one producer warp group issuing the TMA loads, two consumer warp groups splitting the
128-row tile), but only with ``num_warps=4`` and only when the kernel has no reductions or scans
(its task-id propagation stops at any op with a region: the in-kernel prefix sum of 400b600's
kernel cannot stay). So here the tile -> (expert, first row, end row) map is built before the GEMM,
and each program of the persistent grid only loads three integers per tile.

Each variant runs in a subprocess that is killed after ``--timeout`` seconds. Each line gives the four
row-ragged GEMMs of the 30B layer (gate_up, down, dgrad, dx), this kernel's ms against CUTLASS's, and
"diff", the max abs difference to CUTLASS. On the H200 with triton 3.6 every warp-specialized
variant hung, and only the unspecialized one (variant 0) finished
(bench/results/probe_ws_gemm_2026-12-01.log, bench/KERNELS_NOTES.md). The product's kernel is
moe_fuse/kernels/ragged_gemm.py.
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
from triton.testing import do_bench  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from check_kernels_gpu import PROBE_LAYERS  # noqa: E402
from probe_tile_waste_gpu import router_ids  # noqa: E402


@triton.jit
def _ws_gemm(a_desc, b_desc, out_ptr, tiles_ptr, N, K, stride_om, num_programs,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, B_KMAJOR: tl.constexpr,
             WS_OUTER: tl.constexpr, WS_INNER: tl.constexpr):
    num_m = tl.load(tiles_ptr)
    num_n = tl.cdiv(N, BN)
    for t in tl.range(tl.program_id(0), num_m * num_n, num_programs, warp_specialize=WS_OUTER):
        m_tile = t // num_n
        n0 = (t % num_n) * BN
        e = tl.load(tiles_ptr + 1 + 3 * m_tile)
        row0 = tl.load(tiles_ptr + 2 + 3 * m_tile)
        row_end = tl.load(tiles_ptr + 3 + 3 * m_tile)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in tl.range(0, K, BK, warp_specialize=WS_INNER):
            a = a_desc.load([row0, k0])
            if B_KMAJOR:
                b = b_desc.load([e * N + n0, k0]).T
            else:
                b = b_desc.load([e * K + k0, n0])
            acc = tl.dot(a, b, acc)
        rows = row0 + tl.arange(0, BM)
        cols = n0 + tl.arange(0, BN)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows < row_end)[:, None])


def tile_map(counts: torch.Tensor, bm: int) -> torch.Tensor:
    """int32 [1 + 3 * bound]: the number of M tiles, then (expert, first row, end row) per tile."""
    E = counts.numel()
    dev = counts.device
    per = (counts + bm - 1) // bm
    starts = torch.cumsum(counts, 0) - counts
    num = int(per.sum())
    e = torch.repeat_interleave(torch.arange(E, device=dev), per)
    first = torch.cumsum(per, 0) - per
    i = torch.arange(num, device=dev)
    row0 = starts[e] + (i - first[e]) * bm
    row_end = starts[e] + counts[e]
    out = torch.empty(1 + 3 * num, dtype=torch.int32, device=dev)
    out[0] = num
    out[1:] = torch.stack([e, row0, row_end], 1).flatten().to(torch.int32)
    return out


def ws_gemm(a, b, tiles, *, b_kmajor, bm, bn, bk, stages, ws, warps=None):
    E = b.shape[0]
    N, K = (b.shape[1], b.shape[2]) if b_kmajor else (b.shape[2], b.shape[1])
    out = torch.empty(a.shape[0], N, dtype=a.dtype, device=a.device)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    if b_kmajor:
        b_desc = TensorDescriptor.from_tensor(b.view(E * N, K), [bn, bk])
    else:
        b_desc = TensorDescriptor.from_tensor(b.view(E * K, N), [bk, bn])
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    warps = warps or (4 if ws else 8)
    if ws.startswith("flat"):
        # one program per tile: the persistent loop runs at most once (at 4d89733, when the log was
        # taken, a separate kernel with an `if` in place of the loop)
        bound = (a.shape[0] // bm + E) * triton.cdiv(N, bn)
        _ws_gemm[(bound,)](a_desc, b_desc, out, tiles, N, K, out.stride(0), bound, BM=bm, BN=bn, BK=bk,
                           B_KMAJOR=b_kmajor, WS_OUTER=False, WS_INNER=ws == "flat_inner", num_warps=warps,
                           num_stages=stages)
        return out
    _ws_gemm[(sms,)](a_desc, b_desc, out, tiles, N, K, out.stride(0), sms, BM=bm, BN=bn, BK=bk, B_KMAJOR=b_kmajor,
                     WS_OUTER=ws == "outer", WS_INNER=ws == "inner", num_warps=warps, num_stages=stages)
    return out


# (bm, bn, bk, stages, ws, warps); ws: "" none, "inner" / "outer" the K loop / the persistent tile loop,
# "flat" / "flat_inner" one program per tile
VARIANTS = [(128, 256, 64, 3, "", 8), (128, 256, 64, 3, "flat_inner", 4), (128, 256, 64, 3, "inner", 4),
            (128, 256, 64, 3, "outer", 4), (128, 256, 64, 4, "outer", 4), (128, 128, 64, 4, "outer", 4),
            (128, 256, 64, 4, "inner", 4), (128, 256, 64, 3, "flat", 8)]


def run_variant(args, variant):
    bm, bn, bk, st, ws, w = variant
    dev = torch.device("cuda")
    tag = f"{bm}x{bn}x{bk} s{st} w{w} {ws or 'nows'}"
    for case in args.cases.split(","):
        gen = torch.Generator(device=dev).manual_seed(0)
        layer, T = case.split(":")
        T = int(T)
        H, I, E, k = PROBE_LAYERS[layer]
        S = T * k
        wgu = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
        wd = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
        xs = torch.randn(S, H, device=dev, dtype=torch.bfloat16, generator=gen)
        aw = torch.randn(S, I, device=dev, dtype=torch.bfloat16, generator=gen)
        dh = torch.randn(S, 2 * I, device=dev, dtype=torch.bfloat16, generator=gen)
        dists = {"exact": torch.full((E,), S // E, device=dev),
                 "router": torch.bincount(router_ids(T, H, E, k, dev, gen).flatten(), minlength=E)}
        for name in args.dists.split(","):
            counts = dists[name]
            ends = torch.cumsum(counts, 0).to(torch.int32)
            tiles = tile_map(counts, bm)
            row = []
            for label, act, b, kmajor, cutlass in (
                ("gate_up", xs, wgu, True, lambda: torch._grouped_mm(xs, wgu.transpose(1, 2), offs=ends)),
                ("down", aw, wd, True, lambda: torch._grouped_mm(aw, wd.transpose(1, 2), offs=ends)),
                ("dgrad", xs, wd, False, lambda: torch._grouped_mm(xs, wd, offs=ends)),
                ("dx", dh, wgu, False, lambda: torch._grouped_mm(dh, wgu, offs=ends)),
            ):
                ref = cutlass()
                fn = lambda: ws_gemm(act, b, tiles, b_kmajor=kmajor, bm=bm, bn=bn, bk=bk,  # noqa: E731
                                     stages=st, ws=ws, warps=w)
                try:
                    out = fn()
                    torch.cuda.synchronize()
                    diff = (out.float() - ref.float()).abs().max().item()
                    ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
                    ms_c = do_bench(cutlass, warmup=25, rep=200, return_mode="median")
                    row.append(f"{label} {ms:.3f} vs {ms_c:.3f} (diff {diff:.2g})")
                except Exception as ex:  # noqa: BLE001
                    row.append(f"{label} failed ({type(ex).__name__}: {str(ex)[:80]})")
            print(f"  {case} {name:<6} {tag:<28} " + " | ".join(row), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="30b:16384,30b:4096")
    ap.add_argument("--dists", default="exact,router")
    ap.add_argument("--variants", default="", help="indices into VARIANTS (default all)")
    ap.add_argument("--one", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds per variant (a hung kernel is killed)")
    args = ap.parse_args()
    if args.one >= 0:
        run_variant(args, VARIANTS[args.one])
        return
    import subprocess
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__,
          "; each variant: ours ms vs CUTLASS ms, diff = max abs to CUTLASS", flush=True)
    idx = [int(i) for i in args.variants.split(",")] if args.variants else range(len(VARIANTS))
    for i in idx:
        cmd = [sys.executable, __file__, "--one", str(i), "--cases", args.cases, "--dists", args.dists]
        try:
            subprocess.run(cmd, timeout=args.timeout, check=False)
        except subprocess.TimeoutExpired:
            print(f"  variant {i} {VARIANTS[i]}: killed after {args.timeout:.0f} s (hung)", flush=True)


if __name__ == "__main__":
    main()
