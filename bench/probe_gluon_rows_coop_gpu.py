#!/usr/bin/env python3
"""Probe: the row-ragged gate_up and dgrad GEMMs with their A rows gathered (x[token], dy[token]) on cooperative
128 x 256 tiles.

    PYTHONPATH=. python3 bench/probe_gluon_rows_coop_gpu.py [--shape 30b] [--tokens 16384] [--seconds 2]
    PYTHONPATH=. python3 bench/probe_gluon_rows_coop_gpu.py --compile      # CPU: compile for sm90, ptxas -v

The other half of dropping the sorted copy xs (bench/KERNELS_NOTES.md, "the step's bytes read off the
counters"): besides dW_gate_up (bench/probe_gluon_wgrad_coop_gpu.py), the forward's gate_up GEMM reads xs, and
would have to gather x's rows itself. With Triton's pointer loads that was 5-8% slower (fourteenth session).
The kernel is ``bench/gluon_gathered.py``'s, in Gluon: a
4-warp loader gathers the stage's A tile [128 rows, 64] with cp.async (each thread 8 16-byte pieces, arriving on
the stage's barrier when they land) and issues the TMA loads of the weight tile's two halves ([128, 64] each); the
two consumer warpgroups share the gathered A and each multiplies its own 128 output columns, so the gathered bytes
per FLOP are half those of a 128 x 128 tile (and with 8 loader warps, half the pieces a thread). Epilogue from
registers (32 K steps a tile at H = 2048, so it weighs little).

Tiles: 128 rows of one expert each, from moe_fuse's tile map (``ragged_gemm.tile_map``, built on the device).
The gathered variant runs on the unpadded sorted layout moe_fuse writes (rows past a tile's end gathered as
zeros, not stored); the TMA variant reads a copy with each expert's rows padded to whole tiles (``pad``), its
padding rows dropped before comparing.
dgrad (dys @ W_down[e], W_down [E, H, I]: the weight tile's halves are column blocks, wgmma's B read N-major) is
the same kernel with ``b_kmajor=False``: with the weight-gradient probe's dW_down it sizes the readers of dys.
A third variant writes the sorted copy as a by-product (``copy``: consumer 0 stores each gathered stage of a tile's
first N tile while its MMA runs), for a step that keeps the copies for the weight gradients but drops the expand
passes and the GEMMs' reads of the copies: "gathered + copy" against "expand + CUTLASS" sizes that.
Prints, per GEMM, the error against CUTLASS on the sorted copy and bitwise equality, then at the power cap ms and
NVML mJ per call of CUTLASS, expand + CUTLASS, and both variants.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_gather_wgrad_gpu import SHAPES  # noqa: E402  (H, I, E, k)
from probe_gluon_wgrad_gpu import probe_args  # noqa: E402

from gluon_gathered import BM, LAUNCHES, compile_sm90, rows_gemm  # noqa: E402


def compile_report():
    """Every launch compiled for sm90 (no GPU needed), with ptxas -v's registers and spills."""
    from triton.backends.nvidia.compiler import get_ptxas

    for gather, b_kmajor, lw, write_a in LAUNCHES:
        k = compile_sm90(gather, b_kmajor, lw, write_a)
        with tempfile.TemporaryDirectory() as d:
            open(d + "/k.ptx", "w").write(k.asm["ptx"])
            out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", d + "/k.ptx", "-o", d + "/k.cubin"],
                                 capture_output=True, text=True)
        print(f"GATHER={gather} B_KMAJOR={b_kmajor} LW={lw} WRITE_A={write_a}: shared {k.metadata.shared} B; "
              f"wgmma {'wgmma.mma_async' in k.asm['ptx']}\n{out.stdout + out.stderr}")


def main():
    args = probe_args()
    if args.compile:
        return compile_report()

    from probe_gather_wgrad_gpu import routed_inputs
    from probe_gluon_wgrad_gpu import check_then_time, pad, padded_offsets, report_check

    from moe_fuse.kernels.permute import expand_rows
    from moe_fuse.kernels.ragged_gemm import GPU_CONFIG, tile_map

    assert GPU_CONFIG.block_m == BM

    H, I, E, k = SHAPES[args.shape]
    T, S, dev = args.tokens, args.tokens * k, "cuda"
    x, dy, _, _, routing = routed_inputs(H, I, E, k, T, dev)  # the other probes' inputs, the same draws
    gen = torch.Generator(device=dev).manual_seed(1)
    w_gate_up = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H**-0.5).to(torch.bfloat16)
    w_down = (torch.randn(E, H, I, device=dev, generator=gen) * H**-0.5).to(torch.bfloat16)
    ends = routing.offsets[1:]
    pos = routing.pos.view(T, k)
    offp, rows_p = padded_offsets(routing, BM, f"{args.shape} T={T}")
    keep = pad(torch.ones(S, 1, device=dev), routing.offsets, offp, rows_p).view(-1).bool()  # padding rows: False
    tiles_p, tiles = tile_map(offp, rows_p), tile_map(routing.offsets, S)  # GPU_CONFIG's 128-row tiles = BM
    # the two readers of a sorted copy along M: gate_up (xs, W_gate_up [E, 2I, H]) and dgrad (dys, W_down [E, H, I])
    cases = {"gate_up": (x, w_gate_up, True, lambda a_s: torch._grouped_mm(a_s, w_gate_up.transpose(1, 2), offs=ends)),
             "dgrad": (dy, w_down, False, lambda a_s: torch._grouped_mm(a_s, w_down, offs=ends))}
    for name, (a, w, kmajor, grouped_mm) in cases.items():
        a_s = expand_rows(a, pos)  # the sorted copy moe_fuse writes today
        a_p = pad(a_s, routing.offsets, offp, rows_p)  # the TMA variant's whole tiles
        flop = 2 * S * w.shape[1] * w.shape[2]
        want = grouped_mm(a_s)
        # the padded variant's output holds padding rows: compared through `keep`, outside its timed call
        padded = rows_gemm(a_p, w, tiles_p, rows_p, b_kmajor=kmajor)
        torch.cuda.synchronize()
        report_check(f"{name:10s} {'coop 128x256, padded':22s}", padded[keep], want)
        del padded
        gathered = {f"coop 128x256, gathered, {lw} lw": lambda lw=lw: rows_gemm(
            a, w, tiles, S, src=routing.token, b_kmajor=kmajor, loader_warps=lw) for lw in (4, 8)}
        # the by-product: the sorted copy written by the GEMM that gathers it (the weight gradients still read it)
        for lw in (4, 8):
            copy = torch.full_like(a_s, float("nan"))
            rows_gemm(a, w, tiles, S, src=routing.token, b_kmajor=kmajor, loader_warps=lw, copy=copy)
            torch.cuda.synchronize()
            print(f"  {name:10s} the copy written by the gathering GEMM ({lw} lw) bitwise expand_rows': "
                  f"{torch.equal(copy, a_s)}", flush=True)
            gathered[f"coop 128x256, gathered + copy, {lw} lw"] = lambda lw=lw: rows_gemm(
                a, w, tiles, S, src=routing.token, b_kmajor=kmajor, loader_warps=lw, copy=torch.empty_like(a_s))
        del copy
        baselines = {"CUTLASS": lambda: grouped_mm(a_s), "expand + CUTLASS": lambda: grouped_mm(expand_rows(a, pos)),
                     "coop 128x256, padded": lambda: rows_gemm(a_p, w, tiles_p, rows_p, b_kmajor=kmajor)}
        check_then_time(name, gathered, want, baselines, args.seconds, flop, what=" of the routed rows")
        del a_s, a_p


if __name__ == "__main__":
    main()
