#!/usr/bin/env python3
"""Probe: N-tile width of the row-ragged GEMMs at Nemotron-3-Nano's expert shapes (no gate).

    PYTHONPATH=. python3 bench/probe_ungated_tiles_gpu.py [--tokens 16384] [--rounds 3]

H 2688, I 1856, E 128, k 6, router counts (top-k of a random router), bf16. The four row-ragged GEMMs
(up [S,H]x[E,I,H]^T, down [S,I]x[E,H,I]^T, dgrad [S,H]x[E,H,I], dx [S,I]x[E,I,H]) through
``kernels/ragged_gemm.py`` at its 128x256 tiles and at 128x128, and through ``torch._grouped_mm`` (CUTLASS),
timed in turn (do_bench medians); every variant's output compared bitwise with CUTLASS's.

Why ask: 256-wide N tiles compute 2048 columns for I = 1856 (+10%) and 2816 for H = 2688 (+5%); 128-wide ones
1920 (+3%) and 2688 (none), at twice the weight-tile loads per FLOP. Qwen3's N (768, 1536, 2048) are whole
multiples of 256, so this choice never arises there.

Answer (bench/results/probe_ungated_tiles{,_t4096}_2026-12-03.log): 128-wide tiles were slower on all four GEMMs at
T=16384 and 4096, and the relu2 op's forward + backward too, with 128x128 chosen for those N (a switch at a5ba44f,
removed after): 12.63-13.07 ms against 12.03-12.67 at T=16384, bitwise equal.
"""

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_fuse.kernels.ragged_gemm import GPU_CONFIG, RaggedConfig, ragged_gemm, tile_map  # noqa: E402
from moe_fuse.kernels.routing import route  # noqa: E402

H, I, E, K = 2688, 1856, 128, 6
CONFIGS = {"128x256 (default)": GPU_CONFIG, "128x128 w8 s4": RaggedConfig(128, 128, 64, 8, 4),
           "128x128 w4 s4": RaggedConfig(128, 128, 64, 4, 4)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    T, dev = args.tokens, "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
    ids = torch.topk((x @ (torch.randn(E, H, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02).t())
                     .float().softmax(-1), K, dim=-1).indices
    S = T * K
    r = route(ids, E)
    ends = r.offsets[1:]
    w_up = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16, generator=gen) * H**-0.5
    w_down = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=gen) * I**-0.5
    xs = torch.randn(S, H, device=dev, dtype=torch.bfloat16, generator=gen)
    a = torch.randn(S, I, device=dev, dtype=torch.bfloat16, generator=gen)
    # name: (A, weights, b_kmajor)
    gemms = {"up": (xs, w_up, True), "down": (a, w_down, True), "dgrad": (xs, w_down, False), "dx": (a, w_up, False)}
    print(f"{torch.cuda.get_device_name()} T={T} S={S}; expert rows min/max {int(r.counts.min())}/{int(r.counts.max())}")
    for name, (A, W, kmajor) in gemms.items():
        N = W.shape[1] if kmajor else W.shape[2]
        flop = 2 * S * A.shape[1] * N
        want = torch._grouped_mm(A, W.transpose(1, 2) if kmajor else W, offs=ends)
        variants = {"CUTLASS": lambda A=A, W=W, kmajor=kmajor: torch._grouped_mm(
            A, W.transpose(1, 2) if kmajor else W, offs=ends)}
        for cname, cfg in CONFIGS.items():
            tiles = tile_map(r.offsets, S, config=cfg)
            variants[cname] = lambda A=A, W=W, kmajor=kmajor, tiles=tiles, cfg=cfg: ragged_gemm(
                A, W, tiles, b_kmajor=kmajor, config=cfg)
        same = {n: torch.equal(fn()[: int(r.offsets[-1])], want[: int(r.offsets[-1])]) for n, fn in variants.items()}
        times = {n: [] for n in variants}
        for _ in range(args.rounds):
            for n, fn in variants.items():
                times[n].append(do_bench(fn, warmup=10, rep=100))
        line = ", ".join(f"{n} {min(t):.3f} ms ({flop / min(t) / 1e9:.0f} TFLOP/s{'' if same[n] else ', DIFFERS'})"
                         for n, t in times.items())
        print(f"  {name:<5} N={N} K={A.shape[1]}: {line}", flush=True)


if __name__ == "__main__":
    main()
