#!/usr/bin/env python3
"""GPU check and timing of kernels/gluon_wgrad.py, the cooperative weight-gradient kernel, against CUTLASS.

    PYTHONPATH=. python3 bench/check_gluon_wgrad_gpu.py [--shape 30b] [--tokens 16384] [--seconds 2]

1. Both weight gradients of the layer (dW_gate_up = d_h^T xs, dW_down = dys^T aw) with a real router's counts:
   bitwise against CUTLASS, and two runs bitwise equal to each other.
2. At the power cap (NVML): ms and mJ per call of CUTLASS and of this kernel, both gradients.
3. Edge cases against ``torch._grouped_mm`` (CUTLASS) and float64 on fresh random inputs: experts without rows,
   experts of 1-63 rows, rows past offsets[E] (expert-parallel sentinels, in no group; NaN in both operands), P's
   columns an odd multiple of 128, one expert holding every row. Printed: relative error against float64 (and
   CUTLASS's), bitwise equality with CUTLASS, a repeat bitwise equal, all finite.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_fuse.kernels import gluon_wgrad  # noqa: E402


def cutlass(p, q, offsets):
    return torch._grouped_mm(p.t(), q, offs=offsets[1:])


def float64_ref(p, q, offsets):
    out = torch.zeros(offsets.numel() - 1, p.shape[1], q.shape[1], dtype=torch.float64, device=p.device)
    for e in range(out.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        out[e] = p[lo:hi].double().t() @ q[lo:hi].double()
    return out


def poisoned(fn, *args):
    """fn(*args) after filling the allocator's free blocks of the output's size with NaN, so that an output element
    the kernel leaves unwritten shows (torch.empty reuses the block just freed)."""
    p, q, offsets = args
    junk = torch.full((offsets.numel() - 1, p.shape[1], q.shape[1]), float("nan"), dtype=p.dtype, device=p.device)
    del junk
    return fn(*args)


def edge_case(label, counts, M, N, extra_rows=0, seed=0):
    """Rows past offsets[E] (sentinels) are NaN in both operands: the product leaves them unwritten (d_h, aw), so
    they may hold any bits, and no group may read them."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    S = sum(counts) + extra_rows
    p = torch.randn(S, M, device="cuda", generator=gen).to(torch.bfloat16)
    q = torch.randn(S, N, device="cuda", generator=gen).to(torch.bfloat16)
    p[sum(counts):], q[sum(counts):] = float("nan"), float("nan")
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    want, ref = cutlass(p, q, offsets), float64_ref(p, q, offsets)
    torch.cuda.synchronize()
    got = poisoned(gluon_wgrad.wgrad, p, q, offsets)
    again = poisoned(gluon_wgrad.wgrad, p, q, offsets)
    err = lambda a: ((a.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()  # noqa: E731
    print(f"  {label:44s} vs f64 {err(got):.1e} (CUTLASS {err(want):.1e}), bitwise CUTLASS {torch.equal(got, want)}, "
          f"repeat {torch.equal(got, again)}, finite {bool(got.isfinite().all())}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="30b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)

    from probe_gluon_wgrad_gpu import report_sustained, wgrad_inputs

    w = wgrad_inputs(args.shape, args.tokens)
    S, offsets = w.S, w.routing.offsets
    print(f"{args.shape} T={args.tokens} (S={S}): router counts min {int((offsets[1:] - offsets[:-1]).min())}, "
          f"max {int((offsets[1:] - offsets[:-1]).max())}", flush=True)
    cases = {"dW_gate_up": w.cases["dW_gate_up"][:2], "dW_down": (w.cases["dW_down"][1], w.cases["dW_down"][0])}
    for name, (p, q) in cases.items():  # dW_gate_up = d_h^T xs, dW_down = dys^T aw: the product's calls
        want = cutlass(p, q, offsets)
        got, again = poisoned(gluon_wgrad.wgrad, p, q, offsets), poisoned(gluon_wgrad.wgrad, p, q, offsets)
        torch.cuda.synchronize()
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        print(f"  {name:10s} vs CUTLASS: rel err {err:.1e}, bitwise {torch.equal(got, want)}, repeat bitwise "
              f"{torch.equal(got, again)}", flush=True)
    for name, (p, q) in cases.items():
        flop = 2 * S * p.shape[1] * q.shape[1]
        report_sustained(f"{name:10s} CUTLASS    ", lambda: cutlass(p, q, offsets), args.seconds, flop)
        report_sustained(f"{name:10s} gluon_wgrad", lambda: gluon_wgrad.wgrad(p, q, offsets), args.seconds, flop)

    print("edge cases", flush=True)
    for label, *case in (("uneven, empty and tiny experts", [0, 1, 63, 64, 65, 700, 0, 129, 3, 1000], 256, 256),
                         ("sentinel rows past offsets[E]", [40, 0, 300, 77], 256, 128, 100),
                         ("P columns an odd multiple of 128 (M 384)", [130, 5, 257, 64], 384, 128),
                         ("one expert, all rows", [4096], 512, 384),
                         ("every expert empty, 64 sentinel rows", [0, 0, 0], 256, 128, 64)):
        try:
            edge_case(label, *case)
        except Exception as err:  # one failing case must not hide the others
            print(f"  {label:44s} FAILED: {type(err).__name__}: {err}", flush=True)


if __name__ == "__main__":
    main()
