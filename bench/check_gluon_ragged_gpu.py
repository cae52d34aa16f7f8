#!/usr/bin/env python3
"""GPU check and timing of kernels/gluon_ragged.py against the Triton kernels it stands in for.

    PYTHONPATH=. python3 bench/check_gluon_ragged_gpu.py [--shapes 30b,235b] [--tokens 16384] [--timeout 120]
    PYTHONPATH=. python3 bench/check_gluon_ragged_gpu.py --compile-only     # CPU: compile for sm90, ptxas spills

Per shape, with the router's top-k of random HF-initialised weights (bench/probe_tile_waste_gpu.py):

- each of the four row-ragged GEMMs (gate_up, down, dgrad, dx): Gluon warp-specialized against
  ``ragged_gemm`` (Triton) and ``torch._grouped_mm`` (CUTLASS); outputs must be bitwise equal;
- gate_up + SwiGLU in one kernel against ragged_gemm + the ``swiglu`` pass: h and aw bitwise equal;
- dgrad + dSwiGLU in one kernel against ragged_gemm + the ``dswiglu`` pass: d_h bitwise equal,
  d_weights to fp32 summation order; each fused kernel run twice must give the same bits.

--wgrad: only the weight-gradient GEMMs (``torch._grouped_mm``, K ragged) beside ragged_gemm's gate_up and
down, which do the same FLOPs: with --energy, whether the weight gradients cost more joules per FLOP.

--energy S: instead of do_bench, each variant back to back for S seconds with nvidia-smi sampling
(bench/power.py): ms per call, median power, and energy per call (ms x W). The layer step runs at the
700 W cap, where a step takes about its energy / 700 W, so this is the figure that decides there.

Each shape runs in a subprocess killed after --timeout seconds (a hung kernel costs that, not the call).
Outputs are poisoned (NaN) before every checked run. Times: triton.testing.do_bench medians, each
variant in turn, three rounds.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

SHAPES = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8)}  # H, I, E, k


def compile_only():
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    from moe_fuse.kernels import gluon_ragged as G

    for epi, b_kmajor, block_n in G.LAUNCHES:
        kernel = G.compile_sm90(epi, b_kmajor, block_n)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o", f.name + ".cubin"],
                             capture_output=True, text=True)
        spills = [line.strip() for line in (out.stdout + out.stderr).splitlines() if "spill" in line]
        print(f"EPI={epi} b_kmajor={b_kmajor} BLOCK_N={block_n}: shared {kernel.metadata.shared} bytes; {spills}")


def child(shape: str, T: int, energy: float = 0.0, wgrad: bool = False):
    import triton
    from triton.testing import do_bench

    from moe_fuse.kernels import gluon_ragged as G
    from moe_fuse.kernels.backward import dswiglu
    from moe_fuse.kernels.grouped_mm_path import swiglu
    from moe_fuse.kernels.ragged_gemm import ragged_gemm, tile_map
    from moe_fuse.kernels.routing import route

    H, I, E, k = SHAPES[shape]
    S = T * k
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(bf)

    x = rnd(T, H)
    w_router = rnd(E, H, scale=H**-0.5)
    logits = (x @ w_router.t()).float()
    top = torch.topk(logits.softmax(-1), k, dim=-1)
    ids = top.indices.to(torch.int32)
    weights = (top.values / top.values.sum(-1, keepdim=True)).to(bf)
    routing = route(ids, E)
    tiles = tile_map(routing.offsets, S)
    ends = routing.offsets[1:]
    rw = weights.reshape(-1).contiguous()
    xs = x[routing.token.long()]
    w_gu = rnd(E, 2 * I, H, scale=H**-0.5)
    w_d = rnd(E, H, I, scale=I**-0.5)
    aw_in = rnd(S, I)
    dys = rnd(S, H)
    dh_in = rnd(S, 2 * I)
    print(f"{shape} T={T}: S={S}, rows per expert {routing.counts.min().item()}-{routing.counts.max().item()}",
          flush=True)

    def poisoned(fn):
        # every output allocated inside fn comes from a cache filled with NaN first
        torch.cuda.empty_cache()
        filler = torch.full((S * 2 * I * 3,), float("nan"), device=dev, dtype=bf)
        del filler
        return fn()

    gemms = {
        "gate_up": (xs, w_gu, True),
        "down": (aw_in, w_d, True),
        "dgrad": (dys, w_d, False),
        "dx": (dh_in, w_gu, False),
    }
    rows_bad = []

    def timed(fns):
        if energy:  # ms per call at the power state the loop reaches; print watts and joules too
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from power import run_sustained

            out = {}
            for v, fn in fns.items():
                ms, smp = run_sustained(fn, energy, batch=20)
                st = smp.stats()
                nvml = "" if smp.mj_per_call is None else f" (NVML {smp.mj_per_call:.0f})"
                print(f"    {v:14s} {ms:.3f} ms/call, {st.get('watts', float('nan')):.0f} W, "
                      f"{ms * st.get('watts', float('nan')):.0f} mJ/call{nvml}, "
                      f"{st.get('sm_mhz', float('nan')):.0f} MHz, capped {st.get('capped', float('nan')):.0%}",
                      flush=True)
                out[v] = ms
            return out
        # each variant in turn, three rounds: the median round of do_bench medians
        times = {v: [] for v in fns}
        for _ in range(3):
            for v, fn in fns.items():
                times[v].append(do_bench(fn, warmup=10, rep=100, return_mode="median"))
        return {v: sorted(ts)[1] for v, ts in times.items()}
    if wgrad:  # the weight gradients (CUTLASS, K ragged) beside the row-ragged GEMMs of the same FLOPs
        t = timed({
            "gate_up": lambda: ragged_gemm(xs, w_gu, tiles, b_kmajor=True),
            "dW_gate_up": lambda: torch._grouped_mm(dh_in.t(), xs, offs=ends),
            "down": lambda: ragged_gemm(aw_in, w_d, tiles, b_kmajor=True),
            "dW_down": lambda: torch._grouped_mm(dys.t(), aw_in, offs=ends),
        })
        print("  " + " | ".join(f"{v} {ms:.3f} ms" for v, ms in t.items()), flush=True)
        return
    for name, (a, b, kmajor) in gemms.items():
        want = poisoned(lambda: ragged_gemm(a, b, tiles, b_kmajor=kmajor))
        got = poisoned(lambda: G.ragged_gemm(a, b, tiles, b_kmajor=kmajor))
        ok = torch.equal(want, got)
        if not ok:
            rows_bad.append(name)
            diff = (want.float() - got.float()).abs()
            print(f"  {name}: NOT bitwise equal: max abs diff {diff.max().item():.3e}, nan {got.isnan().sum().item()}")
        cutlass_b = b.transpose(1, 2) if kmajor else b
        fns = {
            "gluon": lambda: G.ragged_gemm(a, b, tiles, b_kmajor=kmajor),
            "triton": lambda: ragged_gemm(a, b, tiles, b_kmajor=kmajor),
            "cutlass": lambda: torch._grouped_mm(a, cutlass_b, offs=ends),
        }
        t = timed(fns)
        print(f"  {name:8s} bitwise={ok}  gluon {t['gluon']:.3f} ms | triton {t['triton']:.3f} | "
              f"cutlass {t['cutlass']:.3f}", flush=True)

    # gate_up + SwiGLU
    def unfused_fwd():
        h = ragged_gemm(xs, w_gu, tiles, b_kmajor=True)
        return h, swiglu(h, routing, rw)

    h_want, aw_want = poisoned(unfused_fwd)
    h_got, aw_got = poisoned(lambda: G.gate_up_swiglu(xs, w_gu, tiles, rw, routing.order))
    h_again, aw_again = poisoned(lambda: G.gate_up_swiglu(xs, w_gu, tiles, rw, routing.order))
    ok = torch.equal(h_want, h_got) and torch.equal(aw_want, aw_got)
    rep = torch.equal(h_got, h_again) and torch.equal(aw_got, aw_again)
    if not ok:
        print(f"  gate_up+swiglu: h equal {torch.equal(h_want, h_got)} (max diff "
              f"{(h_want.float() - h_got.float()).abs().max().item():.3e}), aw equal {torch.equal(aw_want, aw_got)} "
              f"(max diff {(aw_want.float() - aw_got.float()).abs().max().item():.3e})")
    fns = {"fused": lambda: G.gate_up_swiglu(xs, w_gu, tiles, rw, routing.order), "unfused": unfused_fwd,
           "cutlass+pass": lambda: swiglu(torch._grouped_mm(xs, w_gu.transpose(1, 2), offs=ends), routing, rw)}
    t = timed(fns)
    print(f"  gate_up+swiglu bitwise={ok} repeatable={rep}  fused {t['fused']:.3f} ms | triton GEMM + pass "
          f"{t['unfused']:.3f} | cutlass + pass {t['cutlass+pass']:.3f}", flush=True)

    # dgrad + dSwiGLU (h from the forward above)
    h = h_want

    def unfused_bwd():
        g = ragged_gemm(dys, w_d, tiles, b_kmajor=False)
        dh, _, dw = dswiglu(g, h, rw, routing, bf, write_aw=False)
        return dh, dw

    dh_want, dw_want = poisoned(unfused_bwd)
    dh_got, dw_got = poisoned(lambda: G.dgrad_dswiglu(dys, w_d, h, tiles, rw, routing.order, bf))
    dh_again, dw_again = poisoned(lambda: G.dgrad_dswiglu(dys, w_d, h, tiles, rw, routing.order, bf))
    ok_dh = torch.equal(dh_want, dh_got)
    dw_err = ((dw_want.float() - dw_got.float()).abs().max() / dw_want.float().abs().max()).item()
    rep = torch.equal(dh_got, dh_again) and torch.equal(dw_got, dw_again)
    if not ok_dh:
        print(f"  dgrad+dswiglu: d_h max diff {(dh_want.float() - dh_got.float()).abs().max().item():.3e}, "
              f"nan {dh_got.isnan().sum().item()}")
    fns = {"fused": lambda: G.dgrad_dswiglu(dys, w_d, h, tiles, rw, routing.order, bf), "unfused": unfused_bwd,
           "cutlass+pass": lambda: dswiglu(torch._grouped_mm(dys, w_d, offs=ends), h, rw, routing, bf,
                                           write_aw=False)}
    t = timed(fns)
    print(f"  dgrad+dswiglu d_h bitwise={ok_dh} d_weights rel err {dw_err:.1e} repeatable={rep}  fused "
          f"{t['fused']:.3f} ms | triton GEMM + pass {t['unfused']:.3f} | cutlass + pass {t['cutlass+pass']:.3f}",
          flush=True)
    print(f"  triton {triton.__version__}, torch {torch.__version__}; mismatched GEMMs: {rows_bad or 'none'}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="30b")
    ap.add_argument("--tokens", default="16384")
    ap.add_argument("--timeout", type=int, default=180)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--energy", type=float, default=0.0, help="seconds per variant back to back, with power samples")
    ap.add_argument("--wgrad", action="store_true",
                    help="only: the CUTLASS weight-gradient GEMMs beside gate_up / down (the same FLOPs)")
    ap.add_argument("--child", default="")
    args = ap.parse_args()
    if args.compile_only:
        return compile_only()
    if args.child:
        shape, T = args.child.split(":")
        return child(shape, int(T), args.energy, args.wgrad)
    print(torch.cuda.get_device_name(), flush=True)
    for shape in args.shapes.split(","):
        for T in args.tokens.split(","):
            try:
                subprocess.run([sys.executable, __file__, "--child", f"{shape}:{T}", "--energy", str(args.energy),
                                *(["--wgrad"] if args.wgrad else [])], timeout=args.timeout, check=False)
            except subprocess.TimeoutExpired:
                print(f"{shape} T={T}: killed after {args.timeout} s (hung?)", flush=True)


if __name__ == "__main__":
    main()
