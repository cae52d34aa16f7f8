#!/usr/bin/env python3
"""Check and time kernels/grouped_mm_path.py against the all-Triton kernels, on a GPU, in one run.

    cd <repo> && PYTHONPATH=. python3 bench/check_grouped_mm_path_gpu.py [--cases 30b:16384,30b:4096,235b:16384]

Per case (bf16): uneven Zipf-like routing with empty experts, and balanced routing; on the first case also
expert-parallel sentinels and a stride-0 dy. For both implementations: y and the four gradients against
reference.experts_forward / experts_backward in fp32 on fp32 copies (relative norm), buffers poisoned with
NaN, a second run bitwise equal. Then the times (do_bench median, balanced routing) of the forward keeping h
and the backward reading it. FLOPs: forward 6*S*H*I, backward 12*S*H*I; % of an 8192^3 bf16 matmul.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from check_kernels_gpu import bench_ms, make_tokens, make_weights, matmul_peak, poisoned_buffers, rel_err  # noqa: E402
from moe_fuse import reference  # noqa: E402
from moe_fuse.kernels import backward, forward, grouped_mm_path  # noqa: E402

LAYERS = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8)}  # H, I, E, k
PATHS = {
    "grouped_mm": (grouped_mm_path.experts_forward, grouped_mm_path.experts_backward),
    "triton": (forward.experts_forward, backward.experts_backward),
}
NAMES = ("y", "dx", "d_weights", "dW_gate_up", "dW_down")


def check(label, x, ids, weights, wgu, wd, dy):
    f32 = [t.float() for t in (x, weights, wgu, wd)]
    want = [reference.experts_forward(f32[0], ids, *f32[1:])]
    want += list(reference.experts_backward(dy.float(), f32[0], ids, *f32[1:]))
    for name, (fwd, bwd) in PATHS.items():
        with poisoned_buffers():
            y, h, _ = fwd(x, ids, weights, wgu, wd, save_h=True)
            got = [y, *bwd(dy, x, ids, weights, wgu, wd, h)]
        again = [fwd(x, ids, weights, wgu, wd, save_h=True)[0], *bwd(dy, x, ids, weights, wgu, wd, h)]
        errs = " ".join(f"{n} {rel_err(g, w):.1e}" for n, g, w in zip(NAMES, got, want))
        finite = all(bool(torch.isfinite(g).all()) for g in got)
        repeat = all(torch.equal(a, b) for a, b in zip(got, again))
        print(f"  check {label:24s} {name:10s} {errs}  finite {finite}  repeatable {repeat}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="30b:16384,30b:4096,235b:16384")
    args = ap.parse_args()
    dev = torch.device("cuda")
    peak = matmul_peak(dev)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, matmul peak {peak:.1f} TFLOP/s")
    for n, case in enumerate(args.cases.split(",")):
        layer, T = case.split(":")
        T = int(T)
        H, I, E, k = LAYERS[layer]
        gen = torch.Generator(device=dev).manual_seed(T + n)
        wgu, wd = make_weights(H, I, E, torch.bfloat16, dev, gen)
        print(f"\n=== {layer} T={T} (H={H} I={I} E={E} k={k})")
        dy = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
        for routing in ("uneven", "balanced"):
            x, ids, weights = make_tokens(T, H, E, k, routing, torch.bfloat16, dev, gen)
            check(routing, x, ids, weights, wgu, wd, dy)
        if n == 0:
            sentinel = torch.where(torch.rand(ids.shape, device=dev, generator=gen) < 0.3, ids + E, ids)
            check("ep sentinels", x, sentinel, weights, wgu, wd, dy)
            check("stride-0 dy", x, ids, weights, wgu, wd, torch.ones(1, 1, device=dev, dtype=dy.dtype).expand(T, H))
        unit = 2 * T * k * H * I
        for name, (fwd, bwd) in PATHS.items():
            h = fwd(x, ids, weights, wgu, wd, save_h=True)[1]
            for what, fn, flops in (
                ("forward (keep h)", lambda: fwd(x, ids, weights, wgu, wd, save_h=True), 3 * unit),
                ("backward (read h)", lambda: bwd(dy, x, ids, weights, wgu, wd, h), 6 * unit),
            ):
                ms = bench_ms(fn, dev)
                tf = flops / ms / 1e9
                print(f"  time {name:10s} {what:20s} {ms:8.3f} ms  {tf:6.1f} TFLOP/s  {100 * tf / peak:5.1f}%", flush=True)


if __name__ == "__main__":
    main()
