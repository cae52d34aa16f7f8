#!/usr/bin/env python3
"""Probe: launch configurations of the grouped_mm path's bandwidth-bound passes, and two small
alternatives around them, on one layer shape.

    PYTHONPATH=. python3 bench/probe_pass_configs_gpu.py [--case 30b:16384]

Each pass is launched directly with every configuration in its list (the first is the one the
product uses) and timed with triton's do_bench (L2 flushed between calls): ms, and GB/s of the
bytes it must move. Also: the routing (three launches) at three block sizes, dSwiGLU with and
without its aw output, and the router's dx as a separate GEMM + add against one addmm.
Every configuration's output is compared with the product configuration's (bitwise).

Read it with a trace of the layer (trace_layer_gpu.py): in bench/results/probe_pass_configs_2026-12-01.log
ROUTE_BLOCK 64 read 51 us against 122 at 128, but inside the compiled layer the three routing kernels
took 40 us at 64 and 41 at 128 (trace_layer_aw_kept_2026-12-01.log), and combine tiles of 4x1024 were
as fast as 16x256 there; only the SwiGLU and dSwiGLU tiles were kept.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from check_kernels_gpu import balanced_case  # noqa: E402
from moe_fuse.kernels import backward, grouped_mm_path, permute, routing  # noqa: E402
from moe_fuse.kernels._jit import cdiv  # noqa: E402

ROW_TILES = [(16, 256, 4), (8, 256, 4), (32, 256, 8), (16, 512, 8), (8, 512, 4), (4, 1024, 4), (32, 128, 4), (64, 64, 4)]
PASS_TILES = [(16, 128, 4), (8, 256, 4), (32, 128, 8), (16, 256, 8), (8, 128, 4), (4, 256, 4), (32, 64, 4), (64, 64, 8)]


def report(label, fn, nbytes, check=None):
    ms = do_bench(fn, warmup=25, rep=200)
    ok = "" if check is None else ("  same" if check() else "  DIFFERENT")
    print(f"  {label:<44} {ms * 1e3:8.1f} us  {nbytes / ms / 1e6:7.0f} GB/s{ok}", flush=True)
    return ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="30b:16384")
    args = ap.parse_args()
    dev = torch.device("cuda")
    T, H, I, E, k, gen, wgu, wd, x, ids, weights = balanced_case(args.case, dev)
    S = T * k
    r = routing.route(ids, E)
    ends = r.offsets[1:]
    pos = r.pos.view(T, k)
    rw = weights.reshape(-1).contiguous()
    xs = permute.expand_rows(x, pos)
    h = torch._grouped_mm(xs, wgu.transpose(1, 2), offs=ends)
    g = torch.randn(S, I, device=dev, dtype=torch.bfloat16, generator=gen)
    o = torch.randn(S, H, device=dev, dtype=torch.bfloat16, generator=gen)
    b2 = 2
    print(f"== {args.case}: T={T} S={S} H={H} I={I} E={E} k={k}", flush=True)

    print("expand_rows (BLOCK_T, BLOCK_H, warps)", flush=True)
    want = permute.expand_rows(x, pos)
    for bt, bh, nw in ROW_TILES:
        out = torch.full_like(want, float("nan"))
        launch = lambda: permute._expand_rows_kernel[(cdiv(T, bt), cdiv(H, bh))](  # noqa: E731
            x, pos, out, T, H, TOP_K=k, BLOCK_T=bt, BLOCK_H=bh, num_warps=nw)
        report(f"{bt}x{bh} w{nw}", launch, (T + S) * H * b2, lambda: torch.equal(out, want))

    print("combine_sorted, unweighted (BLOCK_T, BLOCK_H, warps)", flush=True)
    want = permute.combine_sorted(o, pos, None, x.dtype, ids=ids, num_experts=E)
    for bt, bh, nw in ROW_TILES:
        y = torch.full_like(want, float("nan"))
        launch = lambda: permute._combine_sorted_kernel[(cdiv(T, bt), cdiv(H, bh))](  # noqa: E731
            o, pos, pos, ids, y, T, H, E, TOP_K=k, WEIGHTED=False, SENTINELS=True, PROD_DTYPE=tl.bfloat16,
            BLOCK_T=bt, BLOCK_H=bh, num_warps=nw)
        report(f"{bt}x{bh} w{nw}", launch, (S + T) * H * b2, lambda: torch.equal(y, want))

    print("swiglu, weighted (BLOCK_R, BLOCK_I, warps)", flush=True)
    want = grouped_mm_path.swiglu(h, r, rw)
    for br, bi, nw in PASS_TILES:
        a = torch.full_like(want, float("nan"))
        launch = lambda: grouped_mm_path._swiglu_kernel[(cdiv(S, br),)](  # noqa: E731
            h, rw, r.order, a, r.offsets, r.order, r.order, S, I, E, 0.0, 1.0, LIMITED=False, ALPHA_GATE=False,
            GELU_TANH=False, HAS_BIAS=False, INTERLEAVED=False, BLOCK_R=br, BLOCK_I=bi, num_warps=nw)
        report(f"{br}x{bi} w{nw}", launch, S * 3 * I * b2, lambda: torch.equal(a, want))

    for write_aw in (True, False):
        print(f"dswiglu, write_aw={write_aw} (BLOCK_R, BLOCK_I, warps)", flush=True)
        dh_want, aw_want, dw_want = backward.dswiglu(g, h, rw, r, weights.dtype, write_aw=write_aw)
        for br, bi, nw in PASS_TILES:
            dh = torch.full_like(dh_want, float("nan"))
            aw = torch.full_like(dh_want[:, :I], float("nan"))
            dw = torch.full_like(dw_want, float("nan"))
            launch = lambda: backward._dswiglu_kernel[(cdiv(S, br),)](  # noqa: E731
                g, h, rw, r.order, r.offsets, dh, aw, dw, r.order, r.order, S, I, E, 0.0, 1.0, LIMITED=False,
                ALPHA_GATE=False, GELU_TANH=False, WRITE_AW=write_aw, HAS_BIAS=False, INTERLEAVED=False, BLOCK_R=br,
                BLOCK_I=bi, num_warps=nw)
            same = lambda: torch.equal(dh, dh_want) and torch.equal(dw, dw_want) and (  # noqa: E731
                not write_aw or torch.equal(aw, aw_want))
            report(f"{br}x{bi} w{nw}", launch, S * (6 if write_aw else 5) * I * b2, same)

    print("route (three launches), by ROUTE_BLOCK", flush=True)
    want = routing.route(ids, E).buf.clone()
    product_block = routing.ROUTE_BLOCK
    for block in (product_block, 64, 256):
        routing.ROUTE_BLOCK = block
        report(f"ROUTE_BLOCK {block}", lambda: routing.route(ids, E), S * 4 * 4,
               lambda: torch.equal(routing.route(ids, E).buf, want))
    routing.ROUTE_BLOCK = product_block

    print("router dx: d_logits @ W_router added to the experts' dx", flush=True)
    d = torch.randn(T, E, device=dev, dtype=torch.bfloat16, generator=gen)
    wr = torch.randn(E, H, device=dev, dtype=torch.bfloat16, generator=gen)
    dx_e = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
    report("mm, then add", lambda: d @ wr + dx_e, 3 * T * H * b2)
    report("addmm", lambda: torch.addmm(dx_e, d, wr), 2 * T * H * b2)


if __name__ == "__main__":
    main()
