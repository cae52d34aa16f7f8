#!/usr/bin/env python3
"""Check and tune the experts backward that reads the forward's saved h, on a GPU, in one run.

    cd <repo> && PYTHONPATH=. python3 bench/tune_backward_gpu.py --budget-s 420 --out $OUT
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/tune_backward_gpu.py --smoke     # CPU, tiny shapes

1. checks (30B-A3B layer, T=4096, bf16, uneven and balanced routing, EP sentinels): the backward
   with the saved h, defaults and the descriptor (TMA) wgrad, against reference.experts_backward in
   fp32 on fp32 copies (relative norm), buffers poisoned with NaN, two runs bitwise equal.
2. timing, 30B T=16384 balanced: forward with and without keeping h, backward recomputing vs reading
   h, its stages, a sweep of each GEMM's block configuration, the backward with the best of each,
   the weight-gradient GEMMs on a second stream beside dx, and torch autograd of transformers'
   grouped_mm path for scale; then the 235B layer with the 30B winners.

FLOPs: forward 6*S*H*I, backward 12*S*H*I (S = T*k), % of an 8192^3 bf16 matmul measured here.
Writes $OUT/tune_backward_gpu.json (or ./out) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from check_backward_gpu import hf_grads, make_dy  # noqa: E402
from check_kernels_gpu import bench_ms, cfg_str, make_tokens, make_weights, matmul_peak, poisoned_buffers, rel_err  # noqa: E402
from moe_fuse import reference  # noqa: E402
from moe_fuse.kernels import experts_forward, route  # noqa: E402
from moe_fuse.kernels.backward import (  # noqa: E402
    BackwardConfig,
    GemmConfig,
    default_backward_config,
    dgrad,
    dgrad_saved,
    dx_slots,
    experts_backward,
    experts_by_rows,
    wgrad,
)
from moe_fuse.kernels.combine import combine  # noqa: E402

LAYERS = {"30B-A3B": (2048, 768, 128, 8), "235B-A22B": (4096, 1536, 128, 8)}  # H, I, E, k
NAMES = ("dx", "d_weights", "dW_gate_up", "dW_down")
T0 = time.time()

SWEEP = {
    "dgrad": [
        GemmConfig(128, 256, 64, 8, 8, 4, use_tma=True),
        GemmConfig(128, 256, 64, 8, 8, 3, use_tma=True),
        GemmConfig(128, 256, 64, 8, 8, 3),
        GemmConfig(128, 128, 64, 8, 8, 3, use_tma=True),
        GemmConfig(128, 128, 64, 8, 8, 4, use_tma=True),
    ],
    "wgrad": [
        GemmConfig(128, 128, 64, 8, 8, 3),
        GemmConfig(128, 128, 64, 8, 8, 5),
        GemmConfig(128, 128, 64, 8, 8, 6),
        GemmConfig(128, 128, 32, 8, 8, 6),
        GemmConfig(128, 256, 64, 8, 8, 5),
        GemmConfig(128, 128, 64, 8, 4, 5),
        GemmConfig(256, 128, 64, 8, 8, 5),
    ],
    "dx": [
        GemmConfig(128, 256, 64, 8, 8, 4, use_tma=True),
        GemmConfig(128, 256, 64, 8, 8, 3, use_tma=True),
    ],
}


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


class Budget(Exception):
    pass


def check(name, x, ids, weights, w_gate_up, w_down, dy, results, config=None, tol=1.5e-2):
    row = dict(case=name, T=x.shape[0])
    try:
        h = experts_forward(x, ids, weights, w_gate_up, w_down, save_h=True)[1]
        with poisoned_buffers():
            g1 = experts_backward(dy, x, ids, weights, w_gate_up, w_down, h, config=config)
        g2 = experts_backward(dy, x, ids, weights, w_gate_up, w_down, h, config=config)
        row["finite"] = all(bool(torch.isfinite(g).all()) for g in g1)
        row["deterministic"] = all(torch.equal(a, b) for a, b in zip(g1, g2))
        ref = reference.experts_backward(dy.float(), x.float(), ids, weights.float(), w_gate_up.float(), w_down.float())
        row["err"] = {n: rel_err(g, r) for n, g, r in zip(NAMES, g1, ref)}
        if x.dtype == torch.bfloat16 and (ids < w_gate_up.shape[0]).all() and x.is_cuda:
            row["hf_err"] = {n: rel_err(g, r) for n, g, r in zip(NAMES, hf_grads(x, ids, weights, w_gate_up, w_down, dy), ref)}
        row["ok"] = row["finite"] and row["deterministic"] and all(e < tol for e in row["err"].values())
    except Exception:
        row.update(ok=False, error=traceback.format_exc()[-2000:])
    results["checks"].append(row)
    log("check", json.dumps(row, default=str))


def run_checks(layer, T, dev, gen, results, alt_wgrad):
    H, I, E, k = layer
    w_gate_up, w_down = make_weights(H, I, E, torch.bfloat16, dev, gen)
    dy = make_dy(T, H, torch.bfloat16, dev, gen)
    S = T * k
    alt_cfg = None
    if alt_wgrad is not None:
        base = default_backward_config(S, E, H, I, torch.bfloat16, saved_h=True)
        alt_cfg = BackwardConfig(base.dgrad, base.dx, alt_wgrad)
    for routing in ("uneven", "balanced"):
        x, ids, weights = make_tokens(T, H, E, k, routing, torch.bfloat16, dev, gen)
        check(f"saved h, {routing}", x, ids, weights, w_gate_up, w_down, dy, results)
        if alt_cfg is not None:
            check(f"saved h, {routing}, wgrad 5 stages", x, ids, weights, w_gate_up, w_down, dy, results, config=alt_cfg)
    x, ids, weights = make_tokens(T, H, E, k, "uneven", torch.bfloat16, dev, gen)
    ids = torch.where(torch.rand(ids.shape, device=dev, generator=gen) < 0.3, ids + E, ids)  # other ranks' experts
    check("saved h, EP sentinels", x, ids, weights, w_gate_up, w_down, dy, results)
    if alt_cfg is not None:
        check("saved h, EP sentinels, wgrad 5 stages", x, ids, weights, w_gate_up, w_down, dy, results, config=alt_cfg)


def time_layer(lname, layer, T, dev, gen, results, args, peak, sweep: bool, best: dict | None):
    H, I, E, k = layer
    S = T * k
    unit = S * H * I
    w_gate_up, w_down = make_weights(H, I, E, torch.bfloat16, dev, gen)
    x, ids, weights = make_tokens(T, H, E, k, "balanced", torch.bfloat16, dev, gen)
    dy = make_dy(T, H, torch.bfloat16, dev, gen)
    rows = {}
    key = f"{lname} T={T}"
    results["timing"][key] = rows

    def add(name, fn, flops, rep=100):
        if time.time() - T0 > args.budget_s:
            raise Budget(name)
        ms = bench_ms(fn, dev, rep=rep)
        tf = flops / ms / 1e9 if flops else float("nan")
        rows[name] = dict(ms=ms, tflops=tf, pct_peak=100 * tf / peak if flops else float("nan"))
        log(f"{key}: {name:48s} {ms:8.3f} ms  {tf:6.1f} TFLOP/s")
        return ms

    cfg = default_backward_config(S, E, H, I, torch.bfloat16, saved_h=True)
    y, h, _ = experts_forward(x, ids, weights, w_gate_up, w_down, save_h=True)
    add("forward", lambda: experts_forward(x, ids, weights, w_gate_up, w_down), 6 * unit)
    add("forward, keeping h", lambda: experts_forward(x, ids, weights, w_gate_up, w_down, save_h=True), 6 * unit)
    add("backward, recomputing h", lambda: experts_backward(dy, x, ids, weights, w_gate_up, w_down), 12 * unit)
    add("backward, reading h", lambda: experts_backward(dy, x, ids, weights, w_gate_up, w_down, h), 12 * unit)
    if dev.type == "cuda":  # the same-shaped forward GEMM for scale: gathered A rows, K = H, two accumulators
        from moe_fuse.kernels.grouped_gemm import gate_up

        r0 = route(ids, E)
        add("  forward gate_up GEMM alone", lambda: gate_up(x, r0, w_gate_up, k), 4 * unit)
        add("  dgrad recomputing h (old path)", lambda: dgrad(dy, x, r0, weights.reshape(-1).contiguous(), w_gate_up,
                                                              w_down, k), 6 * unit)

    routing = route(ids, E)
    rw = weights.reshape(-1).contiguous()
    by_load = experts_by_rows(routing)
    dh, aw, dwt = dgrad_saved(dy, routing, rw, h, w_down, k, torch.bfloat16)
    slots = dx_slots(dh, routing, w_gate_up, torch.bfloat16)
    stage = {
        "dgrad": (lambda c: dgrad_saved(dy, routing, rw, h, w_down, k, torch.bfloat16, config=c), 2 * unit),
        "dx": (lambda c: dx_slots(dh, routing, w_gate_up, torch.bfloat16, config=c), 4 * unit),
        "wgrad dW_down": (lambda c: wgrad(dy, True, aw, False, routing, E, k, torch.bfloat16, config=c,
                                          experts_by_load=by_load), 2 * unit),
        "wgrad dW_gate_up": (lambda c: wgrad(dh, False, x, True, routing, E, k, torch.bfloat16, config=c,
                                             experts_by_load=by_load), 4 * unit),
    }
    defaults = {"dgrad": cfg.dgrad, "dx": cfg.dx, "wgrad dW_down": cfg.wgrad_down or cfg.wgrad, "wgrad dW_gate_up": cfg.wgrad}
    add("  route", lambda: route(ids, E), 0)
    for name, (fn, flops) in stage.items():
        add(f"  {name} [{cfg_str(defaults[name])}]", lambda fn=fn, c=defaults[name]: fn(c), flops)
    add("  combine", lambda: combine(slots, ids, E, torch.bfloat16), 0)

    chosen = dict(best or defaults)
    if sweep:
        results["sweep"][key] = {}
        for name, (fn, flops) in stage.items():
            kind = "wgrad" if name.startswith("wgrad") else name
            first = (lambda out: out[0] if isinstance(out, tuple) else out)  # dgrad: compare d_h
            want = first(fn(defaults[name]))
            best_ms = None
            for c in SWEEP[kind]:
                if name not in args.sweep:
                    break
                try:
                    err = rel_err(first(fn(c)), want)
                    ms = add(f"    sweep {name} [{cfg_str(c)}]", lambda fn=fn, c=c: fn(c), flops)
                except Budget:
                    raise
                except Exception as e:  # a config that does not compile (shared memory, registers) is skipped
                    log(f"    sweep {name} [{cfg_str(c)}] failed: {repr(e)[:200]}")
                    continue
                results["sweep"][key][f"{name} [{cfg_str(c)}]"] = dict(ms=ms, err=err)
                if err < 1e-2 and (best_ms is None or ms < best_ms):
                    best_ms, chosen[name] = ms, c
        results["best"] = {n: cfg_str(c) for n, c in chosen.items()}
        log("best configs:", results["best"])

    # The backward with the chosen configs, sequential and with the weight gradients on a second stream.
    side = torch.cuda.Stream() if dev.type == "cuda" else None

    def backward_chosen(streams: bool):
        r = route(ids, E)
        order = experts_by_rows(r)
        d_h, a_w, d_wts = dgrad_saved(dy, r, rw, h, w_down, k, torch.bfloat16, config=chosen["dgrad"])
        if streams:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                d_wd = wgrad(dy, True, a_w, False, r, E, k, torch.bfloat16, config=chosen["wgrad dW_down"],
                             experts_by_load=order)
                d_wgu = wgrad(d_h, False, x, True, r, E, k, torch.bfloat16, config=chosen["wgrad dW_gate_up"],
                              experts_by_load=order)
        sl = dx_slots(d_h, r, w_gate_up, torch.bfloat16, config=chosen["dx"])
        dx = combine(sl, ids, E, torch.bfloat16)
        if streams:
            torch.cuda.current_stream().wait_stream(side)
        else:
            d_wd = wgrad(dy, True, a_w, False, r, E, k, torch.bfloat16, config=chosen["wgrad dW_down"],
                         experts_by_load=order)
            d_wgu = wgrad(d_h, False, x, True, r, E, k, torch.bfloat16, config=chosen["wgrad dW_gate_up"],
                          experts_by_load=order)
        return dx, d_wts, d_wgu, d_wd

    add("backward, reading h, chosen configs", lambda: backward_chosen(False), 12 * unit)
    if side is not None:
        seq = backward_chosen(False)
        par = backward_chosen(True)
        torch.cuda.synchronize()
        rows["streams equal sequential"] = all(torch.equal(a, b) for a, b in zip(seq, par))
        add("backward, reading h, chosen, wgrad on a 2nd stream", lambda: backward_chosen(True), 12 * unit)

        def fwd_bwd():
            experts_forward(x, ids, weights, w_gate_up, w_down, save_h=True)
            backward_chosen(False)

        add("kernels forward (keep h) + backward (chosen)", fwd_bwd, 18 * unit)
        add("torch autograd grouped_mm fwd+bwd", lambda: hf_grads(x, ids, weights, w_gate_up, w_down, dy), 18 * unit)
    return chosen


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes")
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--layers", default="30B-A3B,235B-A22B")
    p.add_argument("--no-checks", action="store_true")
    p.add_argument("--sweep", default="dgrad,dx,wgrad dW_down,wgrad dW_gate_up", help="stages to sweep (30B only)")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    results = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", torch=torch.__version__,
                   checks=[], timing={}, sweep={})
    peak = matmul_peak(dev)
    results["peak_tflops"] = peak
    log(f"device {results['device']}, bf16 matmul peak {peak:.0f} TFLOP/s")
    layers = {"tiny": (64, 32, 8, 2)} if args.smoke else {n: LAYERS[n] for n in args.layers.split(",")}
    args.sweep = args.sweep.split(",")
    small_T, big_T = (64, 128) if args.smoke else (4096, 16384)
    first = next(iter(layers.values()))
    alt_wgrad = None if args.smoke else SWEEP["wgrad"][1]  # the deep-pipeline wgrad, checked too
    try:
        if not args.no_checks:
            run_checks(first, small_T, dev, gen, results, alt_wgrad)
        best = None
        for i, (lname, layer) in enumerate(layers.items()):
            chosen = time_layer(lname, layer, big_T, dev, gen, results, args, peak, sweep=i == 0 and not args.smoke,
                                best=best)
            best = best or chosen
    except Budget as b:
        log(f"out of budget at {b}")
    finally:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tune_backward_gpu.json").write_text(json.dumps(results, indent=1, default=str))
        for key, rows in results["timing"].items():
            print(f"-- {key}")
            for name, r in rows.items():
                if isinstance(r, dict):
                    print(f"   {name:56s} {r['ms']:8.3f} ms  {r['tflops']:6.1f} TFLOP/s  {r['pct_peak']:5.1f}% peak")
                else:
                    print(f"   {name:56s} {r}")
        print("checks ok:", all(c.get("ok") for c in results["checks"]))


if __name__ == "__main__":
    main()
