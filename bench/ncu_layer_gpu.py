#!/usr/bin/env python3
"""Probe: HBM and L2 bytes of every kernel of one compiled MoE layer step, read off the hardware counters.

    PYTHONPATH=. python3 bench/ncu_layer_gpu.py [--shape 30b] [--tokens 16384] [--backends moe_fuse,inductor]

The capped layer step costs about its energy / 700 W, and at the cap every byte and FLOP is energy
(bench/KERNELS_NOTES.md). The byte counts so far were counted by hand from the tensors each kernel
must touch; this reads what each kernel really moved. Per backend a child process compiles the block,
runs three steps, then profiles one step (forward + backward) under Nsight Compute with the card's
clocks left alone (``--clock-control none``) and the caches not flushed (``--cache-control none``), so
a kernel's DRAM bytes are what it moves in the step. Prints one row per kernel (duration under ncu's
serialisation, DRAM read / write, L2 bytes) and the sums.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

METRICS = ["gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum"]


def child(shape: str, tokens: int, backend: str) -> None:
    import torch

    from host_profile import layer_step
    from layer_bench import SHAPES, build_block, ensure_moe_fuse_backend

    if backend.startswith("moe_fuse"):
        ensure_moe_fuse_backend()
    block = build_block(shape, "cuda", torch.bfloat16)
    x = torch.randn(1, tokens, SHAPES[shape][0], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    step = layer_step(torch.compile(block, backend=backend, dynamic=False), x, dy, [x, *block.parameters()])
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def profile(shape: str, tokens: int, backend: str, ncu: str) -> list[dict]:
    cmd = [
        ncu, "--clock-control", "none", "--cache-control", "none", "--profile-from-start", "off",
        "--metrics", ",".join(METRICS), "--csv", "--page", "raw",
        sys.executable, __file__, "--child", backend, "--shape", shape, "--tokens", str(tokens),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if run.returncode:
        raise SystemExit(f"ncu failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    lines = run.stdout.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    units = rows[0]
    out = []
    for r in rows[1:]:
        def val(m, scale):  # to us / MB whatever unit ncu printed
            u = units[m]
            v = float(r[m].replace(",", ""))
            f = {"ns": 1e-3, "usecond": 1, "us": 1, "msecond": 1e3, "ms": 1e3, "byte": 1e-6, "Kbyte": 1e-3,
                 "Mbyte": 1, "Gbyte": 1e3, "B": 1e-6, "KB": 1e-3, "MB": 1, "GB": 1e3, "nsecond": 1e-3}[u]
            return v * f * scale
        out.append(dict(name=r["Kernel Name"], us=val(METRICS[0], 1), rd=val(METRICS[1], 1),
                        wr=val(METRICS[2], 1), l2=val(METRICS[3], 1)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="30b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--backends", default="moe_fuse,inductor")
    ap.add_argument("--child", default=None)
    ap.add_argument("--ncu", default="ncu")
    args = ap.parse_args()
    if args.child:
        return child(args.shape, args.tokens, args.child)
    for backend in args.backends.split(","):
        rows = profile(args.shape, args.tokens, backend, args.ncu)
        print(f"== {backend} {args.shape} T={args.tokens}: {len(rows)} kernels "
              "(us under ncu, DRAM read / write MB, L2 MB)", flush=True)
        for r in rows:
            print(f"  {r['us']:9.1f} {r['rd']:9.1f} {r['wr']:9.1f} {r['l2']:10.1f}  {r['name'][:90]}")
        tot = {k: sum(r[k] for r in rows) for k in ("us", "rd", "wr", "l2")}
        print(f"  {tot['us']:9.1f} {tot['rd']:9.1f} {tot['wr']:9.1f} {tot['l2']:10.1f}  total; DRAM "
              f"{(tot['rd'] + tot['wr']) / 1e3:.2f} GB", flush=True)


if __name__ == "__main__":
    main()
