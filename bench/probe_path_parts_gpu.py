#!/usr/bin/env python3
"""Probe: each step of kernels/grouped_mm_path.py alone, and the six GEMMs in other operand layouts.

    PYTHONPATH=. python3 bench/probe_path_parts_gpu.py [--cases 30b:16384,30b:4096]

Balanced routing, bf16. Per step: do_bench median ms, and TFLOP/s for the GEMMs. "alt" rows run the
same product with the weight (or the output) in the other memory order, to see whether CUTLASS's
kernel for that layout is faster than the one the path uses; a transposed weight copy would cost
E*2I*H*2 bytes of traffic per step, so only a large gain would pay.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from check_kernels_gpu import bench_ms, make_tokens, make_weights, matmul_peak  # noqa: E402
from moe_fuse.kernels import route  # noqa: E402
from moe_fuse.kernels.backward import dswiglu  # noqa: E402
from moe_fuse.kernels.grouped_mm_path import swiglu  # noqa: E402
from moe_fuse.kernels.permute import combine_sorted, expand_rows  # noqa: E402

LAYERS = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="30b:16384,30b:4096")
    ap.add_argument("--only", default="", help="comma-separated label prefixes to time (default: all)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, matmul peak {matmul_peak(dev):.1f} TFLOP/s")
    gmm = torch._grouped_mm
    for case in args.cases.split(","):
        layer, T = case.split(":")
        T = int(T)
        H, I, E, k = LAYERS[layer]
        S = T * k
        gen = torch.Generator(device=dev).manual_seed(T)
        wgu, wd = make_weights(H, I, E, torch.bfloat16, dev, gen)
        x, ids, weights = make_tokens(T, H, E, k, "balanced", torch.bfloat16, dev, gen)
        dy = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
        r = route(ids, E)
        ends = r.offsets[1:]
        xs = x.index_select(0, r.token)
        h = gmm(xs, wgu.transpose(1, 2), offs=ends)
        rw = weights.reshape(-1).contiguous()
        a = swiglu(h, r, rw)
        dys = dy.index_select(0, r.token)
        g = gmm(dys, wd, offs=ends)
        dh, aw, _ = dswiglu(g, h, rw, r, weights.dtype)
        o = gmm(a, wd.transpose(1, 2), offs=ends)
        wgu_t = wgu.transpose(1, 2).contiguous()  # [E, H, 2I]
        wd_t = wd.transpose(1, 2).contiguous()  # [E, I, H]
        f1 = 2 * S * H * I  # one S x H x I product
        rows = [
            ("route", lambda: route(ids, E), 0),
            ("gather x (index_select)", lambda: x.index_select(0, r.token), 0),
            ("expand_rows (x read once)", lambda: expand_rows(x, r.pos.view(T, k)), 0),
            ("gate_up  xs @ Wgu^T (path)", lambda: gmm(xs, wgu.transpose(1, 2), offs=ends), 2 * f1),
            ("gate_up  alt: B [E,H,2I] row-major", lambda: gmm(xs, wgu_t, offs=ends), 2 * f1),
            ("swiglu", lambda: swiglu(h, r, rw), 0),
            ("down     a @ Wd^T (path)", lambda: gmm(a, wd.transpose(1, 2), offs=ends), f1),
            ("down     alt: B [E,I,H] row-major", lambda: gmm(a, wd_t, offs=ends), f1),
            ("combine (weighted)", lambda: combine_sorted(o, r.pos.view(T, k), weights, x.dtype, ids=ids, num_experts=E), 0),
            ("g        dys @ Wd (path)", lambda: gmm(dys, wd, offs=ends), f1),
            ("g        alt: B K-major", lambda: gmm(dys, wd_t.transpose(1, 2), offs=ends), f1),
            ("dswiglu", lambda: dswiglu(g, h, rw, r, weights.dtype), 0),
            ("dx rows  dh @ Wgu (path)", lambda: gmm(dh, wgu, offs=ends), 2 * f1),
            ("dx rows  alt: B K-major", lambda: gmm(dh, wgu_t.transpose(1, 2), offs=ends), 2 * f1),
            ("combine (unweighted)", lambda: combine_sorted(o, r.pos.view(T, k), None, x.dtype, ids=ids, num_experts=E), 0),
            ("dW_gu    dh^T @ xs (path)", lambda: gmm(dh.t(), xs, offs=ends), 2 * f1),
            ("dW_gu    alt: xs^T @ dh ([E,H,2I])", lambda: gmm(xs.t(), dh, offs=ends), 2 * f1),
            ("dW_d     dys^T @ aw (path)", lambda: gmm(dys.t(), aw, offs=ends), f1),
            ("dW_d     alt: aw^T @ dys ([E,I,H])", lambda: gmm(aw.t(), dys, offs=ends), f1),
            ("transpose copy of Wgu", lambda: wgu.transpose(1, 2).contiguous(), 0),
        ]
        print(f"\n=== {layer} T={T} S={S} (H={H} I={I} E={E} k={k})")
        for label, fn, flops in rows:
            if args.only and not any(label.startswith(o) for o in args.only.split(",")):
                continue
            ms = bench_ms(fn, dev, rep=200)
            rate = f"{flops / ms / 1e9:7.1f} TFLOP/s" if flops else ""
            print(f"  {label:40s} {ms:7.3f} ms {rate}", flush=True)


if __name__ == "__main__":
    main()
