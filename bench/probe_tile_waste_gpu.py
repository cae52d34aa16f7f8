#!/usr/bin/env python3
"""Probe: what the per-expert row counts cost CUTLASS's grouped GEMMs, at a fixed total of rows.

    PYTHONPATH=. python3 bench/probe_tile_waste_gpu.py [--cases 30b:16384,30b:4096] [--triton-sweep] [--spread 8]

torch._grouped_mm on sm90 runs 128x256 tiles in clusters of two along M: each expert's rows are
computed in whole multiples of 256 (the tail cluster's tiles run on rows past the expert's end and
are dropped). Same S, same weights, different counts per expert:

    exact   S/E rows each                      no tail
    off8    S/E + 8 and S/E - 8, alternating   half the experts start one more cluster
    a128    S/E + 128 and S/E - 128            CUTLASS: a tail cluster; 128-row tiles: none
    a64     S/E + 64 and S/E - 64              a 64-row tail in every expert
    wide    S/E + 256 and S/E - 256            unbalanced, no tail
    router  top-k of a random HF-initialised router (the layer benchmark's routing)

Each line: the 128-row tiles CUTLASS runs for those counts, gate_up, down and dW_gate_up through
``torch._grouped_mm``, and gate_up through the Triton kernel (kernels/grouped_gemm.py: 128-row tiles
per expert, no clusters). ``--triton-sweep``: the Triton gate_up and down at other block shapes.
``--spread F``: the row-ragged GEMMs with F-1 empty groups after every expert (an overlapping view
of the weights), which makes torch pick its 64x128 tiles when the mean rows per group drop to 128.
``--ragged``: the four row-ragged GEMMs through kernels/ragged_gemm.py and CUTLASS, timed in turn.
Findings: bench/KERNELS_NOTES.md, "Rows CUTLASS computes and drops". At 400b600 this probe also
had ``--ragged`` and ``--fused``, which timed two experimental Triton kernels (a persistent TMA
row-ragged GEMM, and GEMMs with the SwiGLU / dSwiGLU pass fused in) against CUTLASS. They are not in
the product: bench/results/probe_ragged_gemm_2026-12-01.log, probe_fused_epilogues_2026-12-01.log.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from check_kernels_gpu import PROBE_LAYERS  # noqa: E402
from moe_fuse.kernels import grouped_gemm  # noqa: E402
from moe_fuse.kernels.grouped_gemm import GemmConfig  # noqa: E402
from moe_fuse.kernels.routing import route  # noqa: E402


def ids_with_counts(counts: torch.Tensor, T: int, k: int, gen) -> torch.Tensor:
    # Expert labels repeated by count, shuffled into [T, k] (a token may repeat an expert: the
    # GEMMs do not care).
    labels = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    return labels[torch.randperm(labels.numel(), device=counts.device, generator=gen)].view(T, k)


def router_ids(T, H, E, k, dev, gen):
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(E, H, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    return torch.topk((x @ w.t()).float().softmax(-1), k, dim=-1).indices


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="30b:16384,30b:4096")
    ap.add_argument("--triton-sweep", action="store_true", help="Triton GEMM block shapes per distribution")
    ap.add_argument("--dists", default="exact,off8,wide,router", help="any of exact,off8,wide,a128,a64,router")
    ap.add_argument("--ragged", action="store_true",
                    help="the four row-ragged GEMMs: kernels/ragged_gemm.py vs CUTLASS, interleaved, bitwise")
    ap.add_argument("--host", action="store_true",
                    help="host time to enqueue one ragged_gemm / tile_map / torch._grouped_mm call")
    ap.add_argument("--spread", type=int, default=0,
                    help="also time the 2D-3D GEMMs with every expert followed by SPREAD-1 empty groups")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    for case in args.cases.split(","):
        layer, T = case.split(":")
        T = int(T)
        H, I, E, k = PROBE_LAYERS[layer]
        S = T * k
        base = S // E
        wgu = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
        wd = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
        xs = torch.randn(S, H, device=dev, dtype=torch.bfloat16, generator=gen)
        a = torch.randn(S, I, device=dev, dtype=torch.bfloat16, generator=gen)
        dh = torch.randn(S, 2 * I, device=dev, dtype=torch.bfloat16, generator=gen)
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
        alt = lambda d: torch.tensor([base + d, base - d] * (E // 2), device=dev)
        dists = {
            "exact": torch.full((E,), base, device=dev),
            "off8": alt(8),
            "wide": alt(256) if base > 256 else alt(base // 2),
            "a128": alt(128),
            "a64": alt(64),
            "router": torch.bincount(router_ids(T, H, E, k, dev, gen).flatten(), minlength=E),
        }
        print(f"\n=== {case}: S={S} H={H} I={I} E={E}; ms (TFLOP/s on the real rows)")
        for name, counts in dists.items():
            if name not in args.dists.split(","):
                continue
            assert int(counts.sum()) == S
            ends = torch.cumsum(counts, 0).to(torch.int32)
            tiles = int(((counts + 127) // 128 + 1).div(2, rounding_mode="floor").mul(2).sum())
            ids = ids_with_counts(counts, T, k, gen)
            r = route(ids, E)
            row = []
            for label, fn, flops in (
                ("gate_up", lambda: torch._grouped_mm(xs, wgu.transpose(1, 2), offs=ends), 2 * S * H * 2 * I),
                ("down", lambda: torch._grouped_mm(a, wd.transpose(1, 2), offs=ends), 2 * S * I * H),
                ("dW_gu", lambda: torch._grouped_mm(dh.t(), xs, offs=ends), 2 * S * H * 2 * I),
                ("triton gate_up", lambda: grouped_gemm.gate_up(x, r, wgu, k), 2 * S * H * 2 * I),
            ):
                ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
                row.append(f"{label} {ms:.3f} ({flops / ms / 1e9:.0f})")
            spread = f"min {int(counts.min())} max {int(counts.max())}"
            print(f"  {name:<7} {spread:<18} 128-row tiles run {tiles:5d} (useful {S / 128:.0f})  " + "  ".join(row),
                  flush=True)
            if args.ragged:
                ragged(xs, a, dh, wgu, wd, r, ends, S)
            if args.host:
                host_cost(xs, wgu, r, ends, S)
            if args.spread:
                spread_groups(xs, a, wgu, wd, ends, args.spread, S, H, I)
            if args.triton_sweep:
                sweep(x, r, wgu, wd, a, k, S)


def ragged(xs, a, dh, wgu, wd, r, ends, S, rounds=3):
    """The four row-ragged GEMMs through kernels/ragged_gemm.py and through CUTLASS, timed in turn
    ``rounds`` times (ours, CUTLASS, ours, ...) so that the card's clock drifts over both alike; the
    tile map is built once, as the layer does per routing. "same": outputs bitwise equal on the
    routed rows."""
    from moe_fuse.kernels.ragged_gemm import ragged_gemm, tile_map

    tiles = tile_map(r.offsets, S)
    n = int(r.offsets[-1])
    row = []
    sums = [0.0, 0.0]
    for label, act, w, kmajor in (("gate_up", xs, wgu, True), ("down", a, wd, True),
                                  ("dgrad", xs, wd, False), ("dx", dh, wgu, False)):
        def ours():
            return ragged_gemm(act, w, tiles, b_kmajor=kmajor)

        def cutlass():
            return torch._grouped_mm(act, w.transpose(1, 2) if kmajor else w, offs=ends)

        same = torch.equal(ours()[:n], cutlass()[:n])
        t = [[], []]
        for _ in range(rounds):
            for i, fn in enumerate((ours, cutlass)):
                t[i].append(do_bench(fn, warmup=10, rep=100, return_mode="median"))
        med = [sorted(v)[len(v) // 2] for v in t]
        sums = [sums[0] + med[0], sums[1] + med[1]]
        row.append(f"{label} {med[0]:.3f} vs {med[1]:.3f}{'' if same else ' DIFFERENT'}")
    print(f"    ragged_gemm vs CUTLASS (medians of {rounds} in turn): " + " | ".join(row)
          + f" | sum {sums[0]:.3f} vs {sums[1]:.3f}", flush=True)


def host_cost(xs, wgu, r, ends, S, calls=50):
    """Microseconds of host time per call, enqueued back to back without syncs (the GPU works on
    a long GEMM queued first, so no call waits for it)."""
    import time

    from moe_fuse.kernels.ragged_gemm import ragged_gemm, tile_map

    from triton.tools.tensor_descriptor import TensorDescriptor

    from moe_fuse.kernels import ragged_gemm as rg

    tiles = tile_map(r.offsets, S)
    E, N, K = wgu.shape
    out = torch.empty(S, N, dtype=xs.dtype, device=xs.device)
    c = rg.GPU_CONFIG
    a_desc = TensorDescriptor.from_tensor(xs, [c.block_m, c.block_k])
    b_desc = TensorDescriptor.from_tensor(wgu.view(E * N, K), [c.block_n, c.block_k])

    def launch_only():  # the Triton launch with descriptors made once
        rg._ragged_gemm_kernel[(132,)](
            xs, a_desc, wgu, b_desc, out, tiles, N, K, xs.stride(0), wgu.stride(0), wgu.stride(1), wgu.stride(2),
            out.stride(0), 132, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, B_KMAJOR=True,
            USE_TMA=True, IEEE=False, num_warps=c.num_warps, num_stages=c.num_stages)

    cases = {
        "descriptors": lambda: (TensorDescriptor.from_tensor(xs, [c.block_m, c.block_k]),
                                TensorDescriptor.from_tensor(wgu.view(E * N, K), [c.block_n, c.block_k])),
        "launch only": launch_only,
        "tile_map": lambda: tile_map(r.offsets, S),
        "ragged_gemm": lambda: ragged_gemm(xs, wgu, tiles, b_kmajor=True),
        "torch._grouped_mm": lambda: torch._grouped_mm(xs, wgu.transpose(1, 2), offs=ends),
    }
    row = []
    for name, fn in cases.items():
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            for _ in range(4):  # keep the GPU busy while the host enqueues
                torch._grouped_mm(xs, wgu.transpose(1, 2), offs=ends)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        row.append(f"{name} {best:.1f} us")
    torch.cuda.synchronize()
    print("    host per call: " + " | ".join(row), flush=True)


def spread_groups(xs, a, wgu, wd, ends, f, S, H, I):
    """The same GEMMs with f * (E - 1) + 1 groups: group f * e is expert e, the others are empty.

    torch picks its tile shape from the mean rows per group: at or below 128 it takes 64x128 tiles
    (ping-pong), so each expert's rows are computed in multiples of 128 instead of 256. The weights
    are an overlapping view (group g starts g / f of an expert into the weights); empty groups read
    nothing.
    """
    E = wgu.shape[0]
    G = f * (E - 1) + 1
    offs = ends.repeat_interleave(f)[:G].contiguous()
    row = []
    for label, act, w_t, flops in (("gate_up", xs, wgu.transpose(1, 2), 4 * S * H * I),
                                   ("down", a, wd.transpose(1, 2), 2 * S * H * I)):
        st = w_t.stride()
        if st[0] % f:
            row.append(f"{label} n/a")
            continue
        spread = w_t.as_strided((G, *w_t.shape[1:]), (st[0] // f, *st[1:]))
        ref = torch._grouped_mm(act, w_t, offs=ends)
        out = torch._grouped_mm(act, spread, offs=offs)
        n = int(ends[-1])
        err = (out[:n].float() - ref[:n].float()).abs().max().item()
        ms = do_bench(lambda: torch._grouped_mm(act, spread, offs=offs), warmup=25, rep=200, return_mode="median")
        row.append(f"{label} {ms:.3f} ({flops / ms / 1e9:.0f}, max diff {err:.2g})")
    print(f"    {G} groups (mean {S / G:.0f} rows): " + "  ".join(row), flush=True)


# (block_m, block_n, block_k, group_m, warps, stages); TMA weights throughout
GATE_UP_SWEEP = [(128, 128, 64, 8, 8, 3), (128, 128, 64, 1, 8, 3), (128, 128, 64, 16, 8, 3), (128, 128, 64, 4, 8, 4),
                 (64, 128, 64, 8, 4, 4), (64, 256, 64, 8, 8, 3), (128, 64, 64, 8, 4, 4), (64, 128, 64, 16, 4, 3)]
DOWN_SWEEP = [(128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (64, 256, 64, 8, 8, 3), (128, 256, 64, 1, 8, 3),
              (128, 256, 64, 16, 8, 3), (64, 128, 64, 8, 4, 4)]


def sweep(x, r, wgu, wd, a, k, S):
    """The Triton gate_up and down kernels at each block shape of the two lists (ms)."""
    rw = torch.rand(S, device=x.device, dtype=torch.bfloat16)
    for label, configs, fn in (
        ("  triton gate_up", GATE_UP_SWEEP, lambda c: grouped_gemm.gate_up(x, r, wgu, k, config=c)),
        ("  triton down", DOWN_SWEEP, lambda c: grouped_gemm.down(a, r, rw, wd, torch.bfloat16, config=c)),
    ):
        row = []
        for bm, bn, bk, gm, w, st in configs:
            c = GemmConfig(bm, bn, bk, gm, w, st, use_tma=True)
            try:
                ms = do_bench(lambda: fn(c), warmup=25, rep=100, return_mode="median")
                row.append(f"{bm}x{bn}x{bk} g{gm} w{w} s{st} {ms:.3f}")
            except Exception as e:  # noqa: BLE001 - a config that does not fit is reported, not fatal
                row.append(f"{bm}x{bn}x{bk} g{gm} w{w} s{st} failed ({type(e).__name__})")
        print(label + ": " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
