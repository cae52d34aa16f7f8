#!/usr/bin/env python3
"""Probe: power and energy of the grouped_mm path's bandwidth-bound passes, against a plain copy.

    PYTHONPATH=. python3 bench/probe_glue_energy_gpu.py [--case 30b:16384] [--seconds 3]

On the H200 the layer step runs at the 700 W power limit (trace_layer_gpu.py --power), so a step
takes about its energy / 700 W, and a pass that draws more power than it needs takes clock away from
the GEMMs. Each pass runs back to back for --seconds with nvidia-smi sampling: ms per call, median
power, energy per call (ms x W), and J per GB of memory traffic, beside torch's copy of the same
number of bytes and one CUTLASS GEMM of the layer; then the forward's first half (gather, gate_up
keeping h, SwiGLU) as the grouped_mm path runs it and as the fused Triton GEMM does, energy per call. (The run in
bench/results/probe_glue_energy_2026-12-01.log, at 89eeb84, also timed dSwiGLU without its aw output.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from check_kernels_gpu import balanced_case  # noqa: E402
from moe_fuse.kernels import route  # noqa: E402
from moe_fuse.kernels import grouped_gemm  # noqa: E402
from moe_fuse.kernels.backward import dswiglu  # noqa: E402
from moe_fuse.kernels.grouped_mm_path import swiglu  # noqa: E402
from moe_fuse.kernels.permute import combine_sorted, expand_rows  # noqa: E402
from power import run_sustained  # noqa: E402



def run_for(fn, seconds):
    ms, smp = run_sustained(fn, seconds, batch=20)
    return ms, smp.stats().get("watts", float("nan")), smp.summary()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="30b:16384")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    dev = torch.device("cuda")
    T, H, I, E, k, gen, wgu, wd, x, ids, weights = balanced_case(args.case, dev)
    S = T * k
    r = route(ids, E)
    ends = r.offsets[1:]
    pos = r.pos.view(T, k)
    xs = expand_rows(x, pos)
    h = torch._grouped_mm(xs, wgu.transpose(1, 2), offs=ends)
    g = torch.randn(S, I, device=dev, dtype=torch.bfloat16, generator=gen)
    rw = weights.reshape(-1).contiguous()
    o = torch.randn(S, H, device=dev, dtype=torch.bfloat16, generator=gen)
    src = torch.randn(S * H // 2, device=dev, dtype=torch.bfloat16, generator=gen)
    dst = torch.empty_like(src)
    b2 = 2  # bytes per bf16
    cases = [
        # label, fn, bytes moved
        ("torch copy_ (0.27 + 0.27 GB)", lambda: dst.copy_(src), 2 * src.numel() * b2),
        ("expand_rows", lambda: expand_rows(x, pos), (T + S) * H * b2),
        ("swiglu", lambda: swiglu(h, r, rw), S * 3 * I * b2),
        ("combine (weighted)", lambda: combine_sorted(o, pos, weights, x.dtype, ids=ids, num_experts=E),
         (S + T) * H * b2),
        ("dswiglu (writes aw)", lambda: dswiglu(g, h, rw, r, weights.dtype), S * 6 * I * b2),
        ("gate_up GEMM (CUTLASS)", lambda: torch._grouped_mm(xs, wgu.transpose(1, 2), offs=ends), 0),
        # The same forward half both ways: gather, gate_up GEMM keeping h, SwiGLU.
        ("expand + CUTLASS gate_up + SwiGLU", lambda: swiglu(
            torch._grouped_mm(expand_rows(x, pos), wgu.transpose(1, 2), offs=ends), r, rw), 0),
        ("Triton gate_up (gather, SwiGLU epilogue, keeps h)",
         lambda: grouped_gemm.gate_up(x, r, wgu, k, save_h=True), 0),
    ]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {layer} T={T}", flush=True)
    for label, fn, nbytes in cases:
        ms, watts, summary = run_for(fn, args.seconds)
        joules = ms * watts / 1e3
        per_gb = f"{joules / (nbytes / 1e9):6.3f} J/GB  {nbytes / ms / 1e9:5.2f} TB/s" if nbytes else ""
        print(f"  {label:50s} {ms:7.3f} ms  {watts:5.0f} W  {joules * 1e3:7.1f} mJ/call  {per_gb}\n"
              f"      {summary}", flush=True)


if __name__ == "__main__":
    main()
