#!/usr/bin/env python3
"""Block shapes of the two weight-gradient GEMMs across batch sizes, on a GPU, in one run.

    PYTHONPATH=. python3 bench/sweep_wgrad_gpu.py [--cases 30b:4096,30b:16384,235b:4096,235b:16384]

The wgrad's reduction runs over each expert's rows (K = T*k/E on balanced routing): 256 rows at
T=4096, 1024 at T=16384. Short reductions leave a deep pipeline no time to fill and make the
epilogue (writing the [M, N] tile) a large share. Each config is checked against the default
(relative norm) and timed (median); TFLOP/s on 2*S*M*N per GEMM.
"""

import argparse
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from check_kernels_gpu import make_tokens, rel_err  # noqa: E402
from moe_fuse.kernels import route  # noqa: E402
from moe_fuse.kernels.backward import _wgrad_config, experts_by_rows, wgrad  # noqa: E402
from moe_fuse.kernels.grouped_gemm import GemmConfig  # noqa: E402

SHAPES = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8)}
CONFIGS = [  # block_m, block_n, block_k, group_m, num_warps, num_stages
    (256, 128, 64, 8, 8, 5),
    (128, 256, 64, 8, 8, 5),
    (256, 128, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 3),
    (128, 128, 64, 8, 4, 3),
    (128, 128, 64, 8, 8, 4),
    (128, 128, 32, 8, 4, 4),
    (128, 64, 64, 8, 4, 3),
    (64, 128, 64, 8, 4, 3),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="30b:4096,30b:16384,235b:4096,235b:16384")
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    for case in args.cases.split(","):
        shape, T = case.split(":")
        T = int(T)
        H, I, E, k = SHAPES[shape]
        x, ids, _ = make_tokens(T, H, E, k, "balanced", bf, dev, gen)
        S = T * k
        dy = torch.randn(T, H, device=dev, dtype=bf, generator=gen)
        aw = torch.randn(S, I, device=dev, dtype=bf, generator=gen)
        dh = torch.randn(S, 2 * I, device=dev, dtype=bf, generator=gen)
        routing = route(ids, E)
        by_load = experts_by_rows(routing)
        gemms = {
            "dW_gate_up": (lambda c: wgrad(dh, False, x, True, routing, E, k, bf, config=c, experts_by_load=by_load),
                           _wgrad_config(S, E, bf, "gate_up"), 2 * S * 2 * I * H),
            "dW_down": (lambda c: wgrad(dy, True, aw, False, routing, E, k, bf, config=c, experts_by_load=by_load),
                        _wgrad_config(S, E, bf, "down"), 2 * S * H * I),
        }
        for name, (fn, default, flops) in gemms.items():
            ref = fn(default).float()
            base = triton.testing.do_bench(lambda: fn(default), warmup=10, rep=60, return_mode="median")
            print(f"== {shape} T={T} {name} (rows/expert {S // E}): default {default} {base:.3f} ms "
                  f"{flops / base / 1e9:.0f} TFLOP/s")
            for c in CONFIGS:
                cfg = GemmConfig(*c)
                try:
                    err = rel_err(fn(cfg).float(), ref)
                    ms = triton.testing.do_bench(lambda: fn(cfg), warmup=10, rep=60, return_mode="median")
                except Exception as e:  # out of shared memory etc.: report and go on
                    print(f"   {c}: {type(e).__name__}: {str(e)[:80]}")
                    continue
                print(f"   {c}: {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s  x{base / ms:.3f}  err {err:.1e}")


if __name__ == "__main__":
    main()
