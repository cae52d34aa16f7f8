#!/usr/bin/env python3
"""Probe: warp-specialised descriptor loops (down, dx) and the backward's row gathers on the second stream.

    PYTHONPATH=. python3 bench/probe_overlap_gpu.py [--tokens 16384,4096]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/probe_overlap_gpu.py --smoke     # CPU, tiny shapes

30B layer shapes, balanced routing, one run. Every variant is checked against the plain kernel on the same
inputs (bitwise), with NaN-poisoned buffers; the backward variants also run twice (bitwise equal).
1. down and dx with and without Triton's warp specialisation of their descriptor K loops.
2. experts_backward reading the saved h, with the x / dy row gathers on the second stream at its start
   (backward.EARLY_GATHERS) or where each weight gradient needs them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from check_kernels_gpu import bench_ms, cfg_str, make_tokens, make_weights, matmul_peak, poisoned_buffers  # noqa: E402
from moe_fuse.kernels import backward, experts_backward, route  # noqa: E402
from moe_fuse.kernels.backward import default_backward_config, dgrad_saved, dx_slots  # noqa: E402
from moe_fuse.kernels.grouped_gemm import default_config, down, gate_up  # noqa: E402


def same(a, b) -> str:
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if torch.equal(a, b):
        return "bitwise"
    d = (a.double() - b.double()).abs().max().item()
    return f"DIFFERS max {d:.3e} nan {bool(torch.isnan(a).any())}"


def run(T, H, I, E, k, dev, dtype, peak):
    gen = torch.Generator(device=dev).manual_seed(T)
    w_gate_up, w_down = make_weights(H, I, E, dtype, dev, gen)
    x, ids, weights = make_tokens(T, H, E, k, "balanced", dtype, dev, gen)
    dy = torch.randn(T, H, device=dev, dtype=dtype, generator=gen)
    S = T * k
    unit = 2 * S * H * I  # FLOPs of one [S, H] x [H, I] GEMM
    routing = route(ids, E)
    rw = weights.reshape(-1).contiguous()

    def line(name, fn, flops=0):
        ms = bench_ms(fn, dev)
        tf = f"{flops / ms / 1e9:6.1f} TFLOP/s {100 * flops / ms / 1e9 / peak:5.1f}%" if flops and peak == peak else ""
        print(f"  {name:60s} {ms:8.3f} ms  {tf}", flush=True)
        return ms

    print(f"\n=== T={T} H={H} I={I} E={E} k={k} {dtype}")
    a0, h0 = gate_up(x, routing, w_gate_up, k, save_h=True)
    r0 = dgrad_saved(dy, routing, rw, h0, w_down, k, dtype)
    # 1. warp-specialised descriptor loops: down and dx
    dcfg = default_config("down", S, E, H, I, dtype)
    xcfg = default_backward_config(S, E, H, I, dtype, saved_h=True).dx
    ref_down = down(a0, routing, weights, w_down, dtype, config=dataclasses.replace(dcfg, warp_spec=False))
    ref_dx = dx_slots(r0[0], routing, w_gate_up, dtype, config=dataclasses.replace(xcfg, warp_spec=False))
    variants = {}
    for base, key in ((dcfg, "down"), (xcfg, "dx")):
        plain = dataclasses.replace(base, warp_spec=False)
        variants[key] = [plain] + [dataclasses.replace(plain, num_stages=s, warp_spec=True) for s in (3, 4)]
    for key, cfgs in variants.items():
        for c in cfgs:
            name = f"{key} [{cfg_str(c)}{' ws' if c.warp_spec else ''}]"
            try:
                if key == "down":
                    fn = lambda c=c: down(a0, routing, weights, w_down, dtype, config=c)  # noqa: E731
                    ref, flops = ref_down, unit
                else:
                    fn = lambda c=c: dx_slots(r0[0], routing, w_gate_up, dtype, config=c)  # noqa: E731
                    ref, flops = ref_dx, 2 * unit
                with poisoned_buffers():
                    out = fn()
                # Sentinel-free balanced routing: every slot row is written.
                print(f"  check {name}: {same(out, ref)}")
                line(name, fn, flops)
            except Exception as e:
                print(f"  {name} FAILED: {repr(e)[:300]}")

    # 2. the whole backward: row gathers early on the second stream, or not
    outs = {}
    for early in (False, True):
        backward.EARLY_GATHERS = early
        with poisoned_buffers():
            first = experts_backward(dy, x, ids, weights, w_gate_up, w_down, h0)
        second = experts_backward(dy, x, ids, weights, w_gate_up, w_down, h0)
        outs[early] = first
        repeat = all(torch.equal(p, q) for p, q in zip(first, second))
        print(f"  check backward early_gathers={early}: two runs bitwise {repeat}")
        line(f"experts_backward early_gathers={early}",
             lambda: experts_backward(dy, x, ids, weights, w_gate_up, w_down, h0), 6 * unit)
    names = ("dx", "d_weights", "dW_gate_up", "dW_down")
    print("  check early vs not: " + ", ".join(f"{n} {same(p, q)}" for n, p, q in zip(names, outs[True], outs[False])))
    backward.EARLY_GATHERS = True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16384,4096")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        run(64, 64, 32, 8, 2, torch.device("cpu"), torch.float32, float("nan"))
        return
    dev = torch.device("cuda")
    peak = matmul_peak(dev)
    print(f"{torch.cuda.get_device_name()} matmul peak {peak:.1f} TFLOP/s")
    for T in map(int, args.tokens.split(",")):
        run(T, 2048, 768, 128, 8, dev, torch.bfloat16, peak)


if __name__ == "__main__":
    main()
