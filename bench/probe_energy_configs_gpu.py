#!/usr/bin/env python3
"""Joules per call of ``ragged_gemm``'s launch settings at the power cap, each row-ragged GEMM of a layer.

    PYTHONPATH=. python3 bench/probe_energy_configs_gpu.py [--shape 30b] [--tokens 16384] [--seconds 3]

The tile settings were chosen by do_bench time (bench/results/probe_ragged_gemm_2026-12-01.log). The layer
step runs at the 700 W cap, where a step takes about its energy / 700 W, so the setting that decides there
is the one with the fewest joules per call. Per GEMM (gate_up, down, dgrad, dx; router counts of random
HF-initialised weights) and per setting: outputs bitwise equal to the default's (poisoned before), then
``bench/power.run_sustained``: ms per call back to back, NVML mJ per call, SM clock. ``exact`` repeats the
default with every expert at 1024 rows (no tile tails), to size what the tails cost in joules.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8)}  # H, I, E, k
# (block_m, block_n, block_k, num_warps, num_stages); the first is GPU_CONFIG
SETTINGS = [
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (128, 256, 128, 8, 2),
    (128, 128, 64, 4, 4),
    (64, 256, 64, 4, 3),
    (64, 256, 64, 4, 4),
    (256, 128, 64, 8, 3),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="30b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--gemms", default="gate_up,down,dgrad,dx")
    args = ap.parse_args()

    from power import run_sustained

    from moe_fuse.kernels.ragged_gemm import GPU_CONFIG, RaggedConfig, ragged_gemm, tile_map
    from moe_fuse.kernels.routing import route

    H, I, E, k = SHAPES[args.shape]
    T, S, dev, bf = args.tokens, args.tokens * k, "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(bf)

    x = rnd(T, H)
    logits = (x @ rnd(E, H, scale=H**-0.5).t()).float()
    top = torch.topk(logits.softmax(-1), k, dim=-1)
    routing = route(top.indices.to(torch.int32), E)
    exact = torch.arange(0, S + 1, S // E, device=dev, dtype=torch.int32)
    w_gu, w_d = rnd(E, 2 * I, H, scale=H**-0.5), rnd(E, H, I, scale=I**-0.5)
    ops = {  # a, b, b_kmajor
        "gate_up": (x[routing.token.long()], w_gu, True),
        "down": (rnd(S, I), w_d, True),
        "dgrad": (rnd(S, H), w_d, False),
        "dx": (rnd(S, 2 * I), w_gu, False),
    }
    print(f"{torch.cuda.get_device_name()}; {args.shape} T={T}: S={S}, rows per expert "
          f"{routing.counts.min().item()}-{routing.counts.max().item()}", flush=True)
    for name in args.gemms.split(","):
        a, b, kmajor = ops[name]
        N, K = (b.shape[1], b.shape[2]) if kmajor else (b.shape[2], b.shape[1])
        flop = 2 * S * N * K
        want = None
        for i, setting in enumerate([*SETTINGS, "exact"]):
            cfg = GPU_CONFIG if setting == "exact" else RaggedConfig(*setting)
            offsets = exact if setting == "exact" else routing.offsets
            tiles = tile_map(offsets, S, config=cfg)
            label = "exact counts" if setting == "exact" else "x".join(map(str, setting[:3])) + f" w{setting[3]} s{setting[4]}"
            out = torch.full((S, N), float("nan"), device=dev, dtype=bf)
            try:
                ragged_gemm(a, b, tiles, b_kmajor=kmajor, out=out, config=cfg)
                torch.cuda.synchronize()
            except Exception as exc:  # a setting that does not compile or fit: say so, go on
                print(f"  {name:8s} {label:22s} failed: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                continue
            if i == 0:
                want = out.clone()
            same = "-" if setting == "exact" else str(torch.equal(out, want))
            ms, smp = run_sustained(lambda: ragged_gemm(a, b, tiles, b_kmajor=kmajor, out=out, config=cfg),
                                    args.seconds, batch=20)
            st = smp.stats()
            mj = smp.mj_per_call
            print(f"  {name:8s} {label:22s} bitwise={same:5s} {ms:.3f} ms/call, "
                  f"{'nan' if mj is None else f'{mj:.0f}'} mJ/call NVML "
                  f"({'nan' if mj is None else f'{mj / flop * 1e9:.3f}'} pJ/FLOP), "
                  f"{st.get('watts', float('nan')):.0f} W, {st.get('sm_mhz', float('nan')):.0f} MHz, "
                  f"capped {st.get('capped', float('nan')):.0%}", flush=True)


if __name__ == "__main__":
    main()
