#!/usr/bin/env python3
"""Probe: the experts op's training step without the sorted copies of x and dy (xs, dys), at the power cap.

    PYTHONPATH=. python3 bench/probe_gathered_layer_gpu.py [--shape 30b] [--tokens 16384] [--seconds 3]
    PYTHONPATH=. TRITON_INTERPRET=1 python3 bench/probe_gathered_layer_gpu.py --cpu-check

The step is energy-bound at the H200's 700 W cap, and xs and dys are the one large byte cut left (~1.2 GB written
and read again a step at 30B T=16384; bench/KERNELS_NOTES.md). They can only go if all four GEMMs that read them
gather rows instead: gate_up and dgrad along M (bench/probe_gluon_rows_coop_gpu.py), dW_gate_up and dW_down along K
(bench/probe_gluon_wgrad_coop_gpu.py). Those probes size each GEMM alone; this one puts them into the step, so
the L2 and the passes around them count too:

    forward   h = x[tok] @ W_gate_up[e]^T (gathered)    aw = w * SwiGLU(h)    o = aw @ W_down[e]^T    y = combine(o)
    backward  g = dy[tok] @ W_down[e] (gathered)        dW_down[e] = dy[tok_e]^T aw_e (gathered along K)
              d_h, d_weights = dSwiGLU(g, h)            o' = d_h @ W_gate_up[e]    dx = combine(o')
              dW_gate_up[e] = d_h_e^T x[tok_e] (gathered along K)

with moe_fuse's routing, tile map, SwiGLU, dSwiGLU, down / dx GEMMs and combines as they are
(``kernels/grouped_mm_path.py``). A second form keeps the copies but has the gathering GEMMs write them as a
by-product, for CUTLASS's weight gradients: no expand pass, and no GEMM reading a copy back along M. Against
moe_fuse's step (forward keeping xs and aw, the three backward ops) and the same with ``keep_rows=False`` (the step
that holds as little), it checks y and every gradient (bitwise and relative error), then times each at the cap,
rounds in turn: ms and NVML mJ per step.

``--cpu-check``: the same composition on the CPU (Triton's interpreter, fp32, small shapes) with the two Gluon
kernels stood in by what they compute (the product's GEMMs on a gathered copy), against float64 autograd of the
reference: the wiring (which rows, which operand, which layout) is checked before any device time is spent.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_fuse import reference  # noqa: E402
from moe_fuse.kernels import grouped_mm_path as gmp  # noqa: E402
from moe_fuse.kernels.backward import dswiglu  # noqa: E402
from moe_fuse.kernels.permute import combine_sorted, expand_rows  # noqa: E402
from moe_fuse.kernels.ragged_gemm import tile_map  # noqa: E402
from moe_fuse.kernels.routing import route  # noqa: E402

SHAPES = {"30b": (2048, 768, 128, 8)}  # H, I, E, k (Qwen3-30B-A3B)


def gathered_step(x, ids, weights, w_gate_up, w_down, dy, gemms, copies=False):
    """(y, dx, d_weights, dW_gate_up, dW_down) of the experts op with no sorted copy of x or dy; with ``copies``,
    the copies written by the GEMMs that gather (no expand pass, no GEMM reading them back) for CUTLASS's weight
    gradients, as moe_fuse's.

    gemms.rows(a, w, tiles, src, b_kmajor, copy): out[p] = a[src[p]] @ B_e over the tile map's rows (B_e = w[e]^T
    with b_kmajor, else w[e]), and a[src] into ``copy`` unless None; gemms.wgrad(p, q, routing, trans_out): [e] =
    p_e^T q[tok_e] ([E, M, N]), or with trans_out its transpose, stored as [E, N, M]."""
    T, k = ids.shape
    S, E = T * k, w_gate_up.shape[0]
    routing = route(ids, E)
    ends, pos = routing.offsets[1:], routing.pos.view(T, k)
    tiles = gmp._tiles(routing, S)  # the down and dx GEMMs' as in moe_fuse (None: torch's grouped GEMM)
    rows_tiles = tile_map(routing.offsets, S)  # the gathered GEMMs' (128-row tiles on the GPU)
    rw = weights.reshape(-1).contiguous()
    xs = x.new_empty(S, x.shape[1]) if copies else None
    h = gemms.rows(x, w_gate_up, rows_tiles, routing.token, True, xs)
    aw = gmp.swiglu(h, routing, rw)
    o = gmp._row_gemm(aw, w_down, tiles, ends, w_kmajor=True)
    y = combine_sorted(o, pos, None, x.dtype, ids=ids, num_experts=E)
    del o
    dys = dy.new_empty(S, dy.shape[1]) if copies else None
    g = gemms.rows(dy, w_down, rows_tiles, routing.token, False, dys)
    d_wd = gmp._wgrad(dys, aw, routing.offsets, False) if copies else gemms.wgrad(aw, dy, routing, True)
    del dys  # before dSwiGLU allocates d_h, as in moe_fuse
    dh, _, d_weights = dswiglu(g, h, rw, routing, weights.dtype, write_aw=False)
    del g, h
    o = gmp._row_gemm(dh, w_gate_up, tiles, ends, w_kmajor=False)
    dx = combine_sorted(o, pos, None, x.dtype, ids=ids, num_experts=E)
    del o
    d_wgu = gmp._wgrad(dh, xs, routing.offsets, False) if copies else gemms.wgrad(dh, x, routing, False)
    return y, dx, d_weights.view(T, k), d_wgu, d_wd


def product_step(x, ids, weights, w_gate_up, w_down, dy, keep_rows=True):
    """moe_fuse's step on the same inputs: the forward that keeps h (and xs, aw), the three backward ops."""
    y, h, routing, *kept = gmp.experts_forward(x, ids, weights, w_gate_up, w_down, save_h=True, keep_rows=keep_rows)
    xs, aw = kept if keep_rows else (None, None)
    dh, d_weights, d_wd = gmp.backward_down(dy, ids, weights, w_down, h, routing, aw)
    del h, aw
    dx, _ = gmp.backward_gate_up(dh, x, ids, w_gate_up, routing)
    d_wgu = gmp.backward_weight_gate_up(dh, x, ids, w_gate_up, routing, xs)
    return y, dx, d_weights, d_wgu, d_wd


def stand_in_gemms():
    """What the two Gluon kernels compute, from moe_fuse's GEMMs on a gathered copy (any device, any dtype)."""

    def rows(a, w, tiles, src, b_kmajor, copy):
        gathered = a[src.long()]
        if copy is not None:
            copy.copy_(gathered)
        return gmp._row_gemm(gathered, w, tiles, None, w_kmajor=b_kmajor)  # tiles: this routing's map

    def wgrad(p, q, routing, trans_out):
        qs = q[routing.token.long()]
        counts = routing.counts.tolist()
        out = torch.zeros(len(counts), p.shape[1], q.shape[1], dtype=torch.float32, device=p.device)
        r = 0
        for e, n in enumerate(counts):
            out[e] = p[r:r + n].float().t() @ qs[r:r + n].float()
            r += n
        out = out.to(p.dtype)
        return out.transpose(1, 2).contiguous() if trans_out else out

    return types.SimpleNamespace(rows=rows, wgrad=wgrad)


def gluon_gemms(sms, loader_warps):
    """The two Gluon kernels (bench/gluon_gathered.py's rows GEMM, the weight-gradient probe's), ``loader_warps`` gathering."""
    from probe_gluon_wgrad_coop_gpu import gluon_wgrad_coop

    from gluon_gathered import rows_gemm

    def rows(a, w, tiles, src, b_kmajor, copy):
        return rows_gemm(a, w, tiles, src.numel(), src=src, b_kmajor=b_kmajor, loader_warps=loader_warps, copy=copy)

    def wgrad(p, q, routing, trans_out):
        return gluon_wgrad_coop(p, q, routing.offsets, routing.counts.numel(), sms, src=routing.token,
                                loader_warps=loader_warps, trans_out=trans_out)

    return types.SimpleNamespace(rows=rows, wgrad=wgrad)


def inputs(H, I, E, k, T, dtype, device, seed=0):
    """x, dy [T, H]; a softmax top-k router's ids and renormalised weights; the two expert weights (nn.Linear
    layouts: W_gate_up [E, 2I, H], W_down [E, H, I])."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)

    x, dy = rnd(T, H), rnd(T, H)
    probs = (x.float() @ rnd(E, H, scale=H**-0.5).float().t()).softmax(-1)
    top, ids = torch.topk(probs, k, dim=-1)
    weights = (top / top.sum(-1, keepdim=True)).to(dtype)
    return x, dy, ids.to(torch.int32), weights, rnd(E, 2 * I, H, scale=H**-0.5), rnd(E, H, I, scale=I**-0.5)


NAMES = ("y", "dx", "d_weights", "dW_gate_up", "dW_down")


def rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def cpu_check():
    """The composition with stand-in GEMMs against float64 autograd of the reference; exits non-zero on a miss."""
    H, I, E, k, T = 32, 16, 6, 2, 40
    x, dy, ids, weights, w_gu, w_down = inputs(H, I, E, k, T, torch.float32, "cpu")
    leaves = [t.double().requires_grad_() for t in (x, weights, w_gu, w_down)]
    y = reference.experts_forward(leaves[0], ids.long(), *leaves[1:])
    want = (y.detach(), *torch.autograd.grad(y, leaves, dy.double()))
    worst = 0.0
    for label, got in (("gathered (stand-ins)", gathered_step(x, ids, weights, w_gu, w_down, dy, stand_in_gemms())),
                       ("gathered + copies (stand-ins)",
                        gathered_step(x, ids, weights, w_gu, w_down, dy, stand_in_gemms(), copies=True)),
                       ("moe_fuse", product_step(x, ids, weights, w_gu, w_down, dy)),
                       ("moe_fuse, keep_rows off", product_step(x, ids, weights, w_gu, w_down, dy, keep_rows=False))):
        errs = [rel(g, w) for g, w in zip(got, want)]
        worst = max(worst, *errs)
        print(f"  {label}: rel err vs float64 " + ", ".join(f"{n} {e:.1e}" for n, e in zip(NAMES, errs)))
    print("cpu check", "ok" if worst < 1e-5 else "FAILED")
    return worst < 1e-5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="30b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cpu-check", action="store_true")
    args = ap.parse_args()
    if args.cpu_check:
        sys.exit(0 if cpu_check() else 1)

    from probe_gluon_wgrad_gpu import report_sustained

    H, I, E, k = SHAPES[args.shape]
    T = args.tokens
    x, dy, ids, weights, w_gu, w_down = inputs(H, I, E, k, T, torch.bfloat16, "cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}; {args.shape} T={T} (S={T * k}), bf16", flush=True)
    steps = {
        "moe_fuse": lambda: product_step(x, ids, weights, w_gu, w_down, dy),
        "moe_fuse, keep_rows off": lambda: product_step(x, ids, weights, w_gu, w_down, dy, keep_rows=False),
        **{f"gathered, {lw} loader warps": lambda lw=lw: gathered_step(x, ids, weights, w_gu, w_down, dy,
                                                                       gluon_gemms(sms, lw)) for lw in (4, 8)},
        **{f"gathered + copies, {lw} loader warps": lambda lw=lw: gathered_step(
            x, ids, weights, w_gu, w_down, dy, gluon_gemms(sms, lw), copies=True) for lw in (4, 8)},
    }
    want = steps["moe_fuse"]()
    for label, step in list(steps.items())[1:]:
        got = step()
        torch.cuda.synchronize()
        print(f"  {label}: " + ", ".join(f"{n} {rel(g, w):.1e}{' =' if torch.equal(g, w) else ''}"
                                         for n, g, w in zip(NAMES, got, want)), flush=True)
    del want, got
    flop = 18 * T * k * H * I  # the six GEMMs': 2 S H x (2I gate_up, I down, I dgrad, 2I dx, 2I dW_gate_up, I dW_down)
    width = max(map(len, steps))
    for r in range(args.rounds):  # in turn, the order reversed every other round
        for label, step in (steps.items() if r % 2 == 0 else reversed(steps.items())):
            report_sustained(f"round {r} {label:{width}s}", step, args.seconds, flop)


if __name__ == "__main__":
    main()
