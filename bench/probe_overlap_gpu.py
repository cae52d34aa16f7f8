#!/usr/bin/env python3
"""Probe: bandwidth-bound passes on a few SMs beside a CUTLASS GEMM that leaves them free.

    PYTHONPATH=. python3 bench/probe_overlap_gpu.py [--cases 30b:16384] [--clocks]

torch._grouped_mm runs a persistent grid of (SMs - carve-out) CTAs, one per SM, so a pass on a
second stream with a grid of at most carve-out programs runs beside it instead of after it. For the
two pairs of the grouped_mm backward that do not depend on each other (dSwiGLU beside dW_down when
the forward kept aw; the dx combine beside dW_gate_up) this times: each GEMM at each carve-out, each
pass alone at each grid size, the serial pair, and the overlapped pair (both launch orders), and checks
that the overlapped results are bitwise the serial ones. --clocks samples nvidia-smi (SM clock,
power, clock-event reasons) during sustained loops of a GEMM and of the serial backward tail.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from check_kernels_gpu import bench_ms, make_tokens, make_weights, matmul_peak  # noqa: E402
from moe_fuse.kernels import route  # noqa: E402
from moe_fuse.kernels.backward import dswiglu  # noqa: E402
from moe_fuse.kernels.grouped_mm_path import sm_carveout, swiglu  # noqa: E402
from moe_fuse.kernels.permute import combine_sorted  # noqa: E402

LAYERS = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8)}


def overlapped(gemm, side_pass, carve: int, side: torch.cuda.Stream, pass_first: bool):
    """gemm() on the current stream with ``carve`` SMs left out, side_pass() on ``side``; joined after."""
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    out = {}

    def run_pass():
        with torch.cuda.stream(side):
            out["pass"] = side_pass()

    if pass_first:
        run_pass()
    with sm_carveout(carve):
        out["gemm"] = gemm()
    if not pass_first:
        run_pass()
    main.wait_stream(side)
    return out


class Sampler:
    """nvidia-smi every 100 ms in the background: (sm MHz, W, power limit W, event reasons)."""

    QUERY = "clocks.sm,power.draw,enforced.power.limit,clocks_event_reasons.active,temperature.gpu"

    def __init__(self):
        self.rows: list[str] = []
        self.proc = None

    def __enter__(self):
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader", "-lms", "100"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.thread = threading.Thread(target=lambda: self.rows.extend(iter(self.proc.stdout.readline, "")))
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.thread.join(timeout=5)

    def summary(self) -> str:
        rows = [r.strip() for r in self.rows if r.strip()]
        if not rows:
            return "  (no nvidia-smi samples)"
        lines = [f"  {len(rows)} samples ({self.QUERY}); every 4th:"]
        lines += [f"    {r}" for r in rows[::4]]
        return "\n".join(lines)


def sustained(fn, seconds: float) -> float:
    """Run fn back to back for ``seconds``; ms per call."""
    torch.cuda.synchronize()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            fn()
        n += 10
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="30b:16384")
    ap.add_argument("--carveouts", default="8,16,24,32")
    ap.add_argument("--clocks", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"matmul peak {matmul_peak(dev):.1f} TFLOP/s", flush=True)
    gmm = torch._grouped_mm
    side = torch.cuda.Stream()
    carves = [int(c) for c in args.carveouts.split(",")]
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
        pos = r.pos.view(T, k)
        xs = x.index_select(0, r.token)
        h = gmm(xs, wgu.transpose(1, 2), offs=ends)
        dys = dy.index_select(0, r.token)
        g = gmm(dys, wd, offs=ends)
        rw = weights.reshape(-1).contiguous()
        dh, aw, _ = dswiglu(g, h, rw, r, weights.dtype)
        o = gmm(dh, wgu, offs=ends)
        f1 = 2 * S * H * I
        print(f"\n=== {layer} T={T} S={S} (H={H} I={I} E={E} k={k})", flush=True)

        def rate(ms, flops):
            return f"{ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s"

        dwd = lambda: gmm(dys.t(), aw, offs=ends)  # noqa: E731
        dwgu = lambda: gmm(dh.t(), xs, offs=ends)  # noqa: E731
        for label, fn, flops in (("dW_d  dys^T @ aw", dwd, f1), ("dW_gu dh^T @ xs", dwgu, 2 * f1)):
            for c in [0] + carves:
                def run(fn=fn, c=c):
                    with sm_carveout(c):
                        return fn()
                print(f"  {label:22s} carve-out {c:2d}   {rate(bench_ms(run, dev, rep=200), flops)}", flush=True)

        dsw = lambda p=None: dswiglu(g, h, rw, r, weights.dtype, write_aw=False, programs=p)  # noqa: E731
        comb = lambda p=None: combine_sorted(o, pos, None, x.dtype, ids=ids, num_experts=E, programs=p)  # noqa: E731
        for label, fn in (("dswiglu (no aw)", dsw), ("combine (dx)", comb)):
            print(f"  {label:22s} full grid      {bench_ms(fn, dev, rep=200):7.3f} ms", flush=True)
            for c in carves:
                print(f"  {label:22s} {c:2d} programs    {bench_ms(lambda: fn(c), dev, rep=200):7.3f} ms", flush=True)
        print(f"  {'dswiglu (writes aw)':22s} full grid      "
              f"{bench_ms(lambda: dswiglu(g, h, rw, r, weights.dtype), dev, rep=200):7.3f} ms", flush=True)

        ref_dh, _, ref_dw = dsw()
        ref_dwd, ref_dwgu, ref_dx = dwd(), dwgu(), comb()
        for label, gemm, ps, check in (
            ("dW_d || dswiglu", dwd, dsw, lambda out: torch.equal(out["gemm"], ref_dwd)
             and torch.equal(out["pass"][0], ref_dh) and torch.equal(out["pass"][2], ref_dw)),
            ("dW_gu || combine", dwgu, comb, lambda out: torch.equal(out["gemm"], ref_dwgu)
             and torch.equal(out["pass"], ref_dx)),
        ):
            serial = bench_ms(lambda: (gemm(), ps()), dev, rep=200)
            print(f"  {label:22s} serial         {serial:7.3f} ms", flush=True)
            for c in carves:
                for first in (False, True):
                    fn = lambda c=c, first=first: overlapped(gemm, lambda: ps(c), c, side, first)  # noqa: E731
                    ok = check(fn())
                    ms = bench_ms(fn, dev, rep=200)
                    print(f"  {label:22s} carve-out {c:2d} {'pass first' if first else 'gemm first'} "
                          f"{ms:7.3f} ms  ({serial - ms:+.3f})  bitwise={ok}", flush=True)

        if args.clocks:
            tail = lambda: (dwd(), dsw(), gmm(dh, wgu, offs=ends), comb(), dwgu())  # noqa: E731
            for label, fn in (("dW_gu GEMM back to back", dwgu), ("backward tail, serial", tail),
                              ("dswiglu back to back", dsw)):
                time.sleep(1.0)
                with Sampler() as smp:
                    ms = sustained(fn, 3.0)
                print(f"\n  {label}: {ms:.3f} ms per call over 3 s\n{smp.summary()}", flush=True)
            print(subprocess.run(["nvidia-smi", "-q", "-d", "POWER,CLOCK,PERFORMANCE"], capture_output=True,
                                 text=True).stdout[-3000:])


if __name__ == "__main__":
    main()
