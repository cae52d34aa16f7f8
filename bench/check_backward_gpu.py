#!/usr/bin/env python3
"""Check and time the Triton experts backward (moe_fuse.kernels.backward) on a GPU.

    cd <repo> && PYTHONPATH=. python3 bench/check_backward_gpu.py [--budget-s 200] [--no-sweep]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/check_backward_gpu.py --smoke     # CPU, tiny shapes

1. correctness at real sizes (Qwen3-30B-A3B and -235B-A22B expert layers, T in
   {4096, 16384}, uneven Zipf-like routing with empty experts, bf16): each of dx,
   d_weights, dW_gate_up, dW_down against reference.experts_backward run in fp32 on
   fp32 copies of the same inputs (relative norm); every buffer the kernels allocate
   poisoned with NaN first; a second run must be bitwise equal. For scale, the same
   errors of torch autograd through transformers' grouped_mm path in bf16. Then, on
   the 30B shape at T=16384: a stride-0 dy and expert-parallel sentinels.
2. timing (triton.testing.do_bench, median), balanced routing (and one uneven row):
   the kernel backward and its stages, the kernel forward + backward, the reference,
   and torch autograd of transformers' grouped_mm experts path (eager): forward
   alone, forward + backward, and their difference as its backward. Backward
   TFLOP/s count 12*T*k*H*I (the kernels execute 16*T*k*H*I: h is recomputed),
   forward + backward 18*T*k*H*I; % peak against an 8192^3 bf16 matmul measured here.
3. sweep (what budget is left): each backward GEMM alone over block configurations,
   30B layer, T=16384, balanced; then the backward with the best of each.
4. fp16 / fp32 checks at T=512 (new compiles: last).

Prints tables last (also when killed by SIGTERM); writes $OUT/check_backward_gpu.json (or ./out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import triton  # noqa: E402

from check_kernels_gpu import (  # noqa: E402
    bench_ms,
    cfg_str,
    make_tokens,
    make_weights,
    matmul_peak,
    poisoned_buffers,
    rel_err,
    transformers_like,
)
from moe_fuse import reference  # noqa: E402
from moe_fuse.kernels import experts_forward, route  # noqa: E402
from moe_fuse.kernels.backward import (  # noqa: E402
    BackwardConfig,
    GemmConfig,
    d_weights_by_row,
    default_backward_config,
    dgrad,
    dx_slots,
    experts_backward,
    wgrad,
)
from moe_fuse.kernels.combine import combine  # noqa: E402

LAYERS = {  # name: (H, I, E, k)
    "30B-A3B": (2048, 768, 128, 8),
    "235B-A22B": (4096, 1536, 128, 8),
}
SMOKE_LAYERS = {"tiny": (40, 24, 6, 2)}
NAMES = ("dx", "d_weights", "dW_gate_up", "dW_down")

# Around the defaults (the first of each list). dgrad: three accumulators, so narrow N or few stages.
# Register and shared-memory use of each was read from ptxas -v for sm_90a on a CPU machine first: the
# 128x128 dgrad tiles spill (96-100 bytes), the rest do not; all fit in shared memory.
SWEEP_DGRAD = [
    GemmConfig(128, 128, 32, 8, 8, 3, use_tma=True),
    GemmConfig(128, 64, 64, 8, 8, 3, use_tma=True),
    GemmConfig(128, 64, 64, 8, 8, 4, use_tma=True),
    GemmConfig(128, 64, 64, 16, 8, 3, use_tma=True),
    GemmConfig(128, 64, 64, 8, 8, 3, use_tma=False),
    GemmConfig(128, 128, 64, 8, 8, 2, use_tma=True),
    GemmConfig(128, 128, 32, 8, 8, 3, use_tma=False),
]
SWEEP_WGRAD = [
    GemmConfig(128, 128, 64, 8, 8, 3),
    GemmConfig(128, 128, 64, 8, 8, 4),
    GemmConfig(128, 256, 64, 8, 8, 3),
    GemmConfig(128, 256, 64, 8, 8, 4),
    GemmConfig(256, 128, 64, 8, 8, 3),
]
SWEEP_DX = [
    GemmConfig(128, 256, 64, 8, 8, 4, use_tma=True),
    GemmConfig(128, 256, 64, 8, 8, 3, use_tma=True),
    GemmConfig(128, 128, 64, 8, 8, 4, use_tma=True),
    GemmConfig(128, 256, 64, 16, 8, 4, use_tma=True),
]

T0 = time.time()


class Budget(Exception):
    pass


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def left(args) -> float:
    return args.budget_s - (time.time() - T0)


# --------------------------------------------------------------------------- inputs and peers


def make_dy(T, H, dtype, dev, gen):
    return torch.randn(T, H, device=dev, dtype=dtype, generator=gen)


def hf_grads(x, ids, weights, w_gate_up, w_down, dy):
    """torch autograd through transformers' grouped_mm experts path (its own dtypes)."""
    leaves = [t.detach().requires_grad_() for t in (x, weights, w_gate_up, w_down)]
    y = transformers_like(leaves[0], ids, *leaves[1:])
    return torch.autograd.grad(y, leaves, dy)


# --------------------------------------------------------------------------- checks


def check_case(name, x, ids, weights, w_gate_up, w_down, dy, w32, results, tol=1.5e-2, hf=True):
    row = dict(case=name, T=x.shape[0])
    try:
        with poisoned_buffers():
            g1 = experts_backward(dy, x, ids, weights, w_gate_up, w_down)
        g2 = experts_backward(dy, x, ids, weights, w_gate_up, w_down)
        row["finite"] = all(bool(torch.isfinite(g).all()) for g in g1)
        row["deterministic"] = all(torch.equal(a, b) for a, b in zip(g1, g2))
        del g2
        wgu32, wd32 = w32 if w32 is not None else (w_gate_up.float(), w_down.float())
        ref = reference.experts_backward(dy.float(), x.float(), ids, weights.float(), wgu32, wd32)
        row["err"] = {n: rel_err(g, r) for n, g, r in zip(NAMES, g1, ref)}
        del g1
        if hf and x.dtype == torch.bfloat16 and (ids < w_gate_up.shape[0]).all():
            try:
                hf = hf_grads(x, ids, weights, w_gate_up, w_down, dy)
                row["hf_err"] = {n: rel_err(g, r) for n, g, r in zip(NAMES, hf, ref)}
            except Exception as e:  # the peer failing must not fail the check
                row["hf_error"] = repr(e)[:300]
        del ref
        row["ok"] = row["finite"] and row["deterministic"] and all(e < tol for e in row["err"].values())
    except Exception:
        row.update(ok=False, error=traceback.format_exc()[-2000:])
    results["checks"].append(row)
    log(f"check {name} T={row['T']}: {json.dumps({k: v for k, v in row.items() if k != 'error'}, default=str)}")
    if "error" in row:
        log(row["error"])


def run_checks(layers, token_counts, dev, gen, results, args):
    for lname, (H, I, E, k) in layers.items():
        w_gate_up, w_down = make_weights(H, I, E, torch.bfloat16, dev, gen)
        w32 = (w_gate_up.float(), w_down.float())
        for T in token_counts:
            x, ids, weights = make_tokens(T, H, E, k, "uneven", torch.bfloat16, dev, gen)
            dy = make_dy(T, H, torch.bfloat16, dev, gen)
            check_case(f"{lname} bf16 uneven", x, ids, weights, w_gate_up, w_down, dy, w32, results)
        if lname == next(iter(layers)):
            T = token_counts[-1]
            x, ids, weights = make_tokens(T, H, E, k, "uneven", torch.bfloat16, dev, gen)
            dy0 = torch.ones(1, 1, device=dev, dtype=torch.bfloat16).expand(T, H)
            check_case(f"{lname} stride-0 dy", x, ids, weights, w_gate_up, w_down, dy0, w32, results, hf=False)
            ids_ep = torch.where(torch.rand(ids.shape, device=dev, generator=gen) < 0.25, E + 1, ids)
            dy = make_dy(T, H, torch.bfloat16, dev, gen)
            check_case(f"{lname} EP sentinels", x, ids_ep, weights, w_gate_up, w_down, dy, w32, results, hf=False)
        del w32, w_gate_up, w_down
        torch.cuda.empty_cache() if dev.type == "cuda" else None


def run_other_dtypes(layers, dev, gen, results):
    lname, (H, I, E, k) = next(iter(layers.items()))
    T = 512 if dev.type == "cuda" else 24
    for dtype, tol in ((torch.float16, 5e-3), (torch.float32, 1e-3)):  # fp32: tf32 dots
        wgu, wd = make_weights(H, I, E, dtype, dev, gen)
        x, ids, weights = make_tokens(T, H, E, k, "uneven", dtype, dev, gen)
        dy = make_dy(T, H, dtype, dev, gen)
        check_case(f"{lname} {str(dtype)[6:]}", x, ids, weights, wgu, wd, dy, None, results, tol=tol, hf=False)


# --------------------------------------------------------------------------- timing


def time_layer(lname, shape, T, dev, gen, results, args, peak, routing_kind="balanced", full=True):
    H, I, E, k = shape
    bwd_flops = 12 * T * k * H * I
    w_gate_up, w_down = make_weights(H, I, E, torch.bfloat16, dev, gen)
    x, ids, weights = make_tokens(T, H, E, k, routing_kind, torch.bfloat16, dev, gen)
    dy = make_dy(T, H, torch.bfloat16, dev, gen)
    rows = {}

    def add(name, fn, flops=bwd_flops, rep=100):
        if left(args) < 5:
            raise Budget(name)
        ms = bench_ms(fn, dev, rep=rep)
        tf = flops / ms / 1e9 if flops else float("nan")
        rows[name] = dict(ms=ms, tflops=tf, pct_peak=100 * tf / peak if flops and peak == peak else float("nan"))

    def kfwd_bwd():
        experts_forward(x, ids, weights, w_gate_up, w_down)
        experts_backward(dy, x, ids, weights, w_gate_up, w_down)

    try:
        add("kernels backward", lambda: experts_backward(dy, x, ids, weights, w_gate_up, w_down))
        if not full:
            add("kernels forward + backward", kfwd_bwd, 18 * T * k * H * I)
            if dev.type == "cuda":
                add("torch autograd grouped_mm fwd+bwd", lambda: hf_grads(x, ids, weights, w_gate_up, w_down, dy),
                    18 * T * k * H * I)
            return
        S = T * k
        cfg = default_backward_config(S, E, H, I, torch.bfloat16)
        routing = route(ids, E)
        rw = weights.reshape(-1).contiguous()
        dh, aw, part = dgrad(dy, x, routing, rw, w_gate_up, w_down, k)
        slots = dx_slots(dh, routing, w_gate_up, torch.bfloat16)
        add("  route", lambda: route(ids, E), 0)
        add("  dgrad (dy W_d, h recompute, dSwiGLU)", lambda: dgrad(dy, x, routing, rw, w_gate_up, w_down, k), 6 * S * H * I)
        add("  dx rows (d_h W_gu)", lambda: dx_slots(dh, routing, w_gate_up, torch.bfloat16), 4 * S * H * I)
        add("  combine", lambda: combine(slots, ids, E, torch.bfloat16), 0)
        add("  wgrad dW_down", lambda: wgrad(dy, True, aw, False, routing, E, k, torch.bfloat16), 2 * S * H * I)
        add("  wgrad dW_gate_up", lambda: wgrad(dh, False, x, True, routing, E, k, torch.bfloat16), 4 * S * H * I)
        add("  d_weights", lambda: d_weights_by_row(part, routing, E, torch.bfloat16), 0)
        del dh, aw, part, slots
        results.setdefault("configs", {})[f"{lname} T={T}"] = {f: cfg_str(getattr(cfg, f)) for f in ("dgrad", "dx", "wgrad")}

        add("kernels forward + backward", kfwd_bwd, 18 * T * k * H * I)
        if dev.type != "cuda":  # the peers below need CUDA (histc on ints, _grouped_mm)
            return
        add("reference backward (eager loop, fp32)", lambda: reference.experts_backward(dy, x, ids, weights, w_gate_up, w_down),
            rep=20)
        leaves = [t.detach().requires_grad_() for t in (x, weights, w_gate_up, w_down)]
        with torch.no_grad():
            add("torch grouped_mm forward (no grad)", lambda: transformers_like(x, ids, weights, w_gate_up, w_down),
                6 * T * k * H * I)

        def hf_fwd():
            return transformers_like(leaves[0], ids, *leaves[1:])

        add("torch autograd grouped_mm forward", hf_fwd, 6 * T * k * H * I)
        add("torch autograd grouped_mm fwd+bwd", lambda: torch.autograd.grad(hf_fwd(), leaves, dy), 18 * T * k * H * I)
        bwd = rows["torch autograd grouped_mm fwd+bwd"]["ms"] - rows["torch autograd grouped_mm forward"]["ms"]
        tf = bwd_flops / bwd / 1e9
        rows["torch autograd grouped_mm backward (difference)"] = dict(ms=bwd, tflops=tf, pct_peak=100 * tf / peak)
    finally:
        results["timing"].append(dict(layer=lname, T=T, routing=routing_kind, rows=rows))
        log(f"timed {lname} T={T} {routing_kind}: " + ", ".join(f"{n.strip()} {r['ms']:.3f}" for n, r in rows.items()))


def sweep(dev, gen, results, args, layers, T):
    lname, (H, I, E, k) = next(iter(layers.items()))
    w_gate_up, w_down = make_weights(H, I, E, torch.bfloat16, dev, gen)
    x, ids, weights = make_tokens(T, H, E, k, "balanced", torch.bfloat16, dev, gen)
    dy = make_dy(T, H, torch.bfloat16, dev, gen)
    S = T * k
    routing = route(ids, E)
    rw = weights.reshape(-1).contiguous()
    dh0, aw0, _ = dgrad(dy, x, routing, rw, w_gate_up, w_down, k)
    sl0 = dx_slots(dh0, routing, w_gate_up, torch.bfloat16)
    dwd0 = wgrad(dy, True, aw0, False, routing, E, k, torch.bfloat16)
    dwgu0 = wgrad(dh0, False, x, True, routing, E, k, torch.bfloat16)
    kinds = [
        ("dgrad", SWEEP_DGRAD, 6 * S * H * I, lambda c: dgrad(dy, x, routing, rw, w_gate_up, w_down, k, config=c)[0], dh0),
        ("wgrad_gate_up", SWEEP_WGRAD, 4 * S * H * I,
         lambda c: wgrad(dh0, False, x, True, routing, E, k, torch.bfloat16, config=c), dwgu0),
        ("wgrad_down", SWEEP_WGRAD, 2 * S * H * I,
         lambda c: wgrad(dy, True, aw0, False, routing, E, k, torch.bfloat16, config=c), dwd0),
        ("dx", SWEEP_DX, 4 * S * H * I, lambda c: dx_slots(dh0, routing, w_gate_up, torch.bfloat16, config=c), sl0),
    ]
    best = {}
    for kind, configs, flops, fn, ref in kinds:
        for cfg in configs:
            if left(args) < 25:
                log("budget reached: sweep stopped")
                return best
            row = dict(layer=lname, T=T, kind=kind, config=cfg_str(cfg))
            try:
                out = fn(cfg)
                row["err_vs_default"] = rel_err(out, ref)
                del out
                row["ms"] = bench_ms(lambda: fn(cfg), dev)
                row["tflops"] = flops / row["ms"] / 1e9
                if row["err_vs_default"] < 1e-2 and (kind not in best or row["ms"] < best[kind][1]):
                    best[kind] = (cfg, row["ms"])
            except Exception as e:
                row["error"] = repr(e)[:300]
            results["sweep"].append(row)
            log("sweep", row)
    # The whole backward with the best of each (wgrad: the one config serves both GEMMs; take gate_up's).
    if left(args) > 20 and all(kd in best for kd in ("dgrad", "dx", "wgrad_gate_up")):
        cfg = BackwardConfig(best["dgrad"][0], best["dx"][0], best["wgrad_gate_up"][0])
        ms = bench_ms(lambda: experts_backward(dy, x, ids, weights, w_gate_up, w_down, config=cfg), dev)
        results["best_backward"] = dict(layer=lname, T=T, ms=ms, tflops=12 * T * k * H * I / ms / 1e9,
                                        configs={kd: cfg_str(c) for kd, (c, _) in best.items()})
        log("best backward", results["best_backward"])
    return best


# --------------------------------------------------------------------------- main


def print_tables(results):
    peak = results.get("matmul_peak_tflops", float("nan"))
    print()
    print(f"device: {results['device']}; torch {results['torch']}, triton {results['triton']}; "
          f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s")
    print("\n== correctness: rel. norm vs reference.experts_backward in fp32 (hf: torch autograd of grouped_mm, bf16) ==")
    for c in results["checks"]:
        if "err" not in c:
            print(f"{c['case']:<26} T={c['T']:<6} ERROR {c.get('error', '').splitlines()[-1:]}")
            continue
        errs = "  ".join(f"{n} {e:.1e}" for n, e in c["err"].items())
        hf = ("   hf: " + " ".join(f"{e:.1e}" for e in c["hf_err"].values())) if "hf_err" in c else ""
        print(f"{c['case']:<26} T={c['T']:<6} {errs}  det={c['deterministic']} "
              f"{'OK' if c['ok'] else 'FAIL'}{hf}")
    print("\n== timing, bf16, median ms (backward TFLOP/s on 12*T*k*H*I, fwd+bwd on 18*, fwd on 6*, stages on their own) ==")
    for t in results["timing"]:
        print(f"-- {t['layer']} T={t['T']} ({t['routing']} routing)")
        for name, r in t["rows"].items():
            tf = f"{r['tflops']:7.1f} TFLOP/s  {r['pct_peak']:5.1f}% peak" if r["tflops"] == r["tflops"] else ""
            print(f"   {name:<48} {r['ms']:9.3f} ms  {tf}")
    if results["sweep"]:
        print("\n== sweep (each GEMM alone, 30B T=16384 balanced; err vs the default config's output) ==")
        for s in results["sweep"]:
            head = f"{s['kind']:<14} {s['config']:<32}"
            if "error" in s:
                print(f"{head} ERROR {s['error'][:100]}")
            else:
                print(f"{head} {s['ms']:7.3f} ms {s['tflops']:6.1f} TFLOP/s err {s['err_vs_default']:.1e}")
    if "best_backward" in results:
        b = results["best_backward"]
        print(f"\nbackward with the best sweep configs ({b['layer']} T={b['T']}): {b['ms']:.3f} ms, "
              f"{b['tflops']:.1f} TFLOP/s; {b['configs']}")
    for e in results.get("errors", []):
        print(f"ERROR in {e['part']}: {e['traceback'].splitlines()[-1]}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes")
    p.add_argument("--budget-s", type=float, default=200.0)
    p.add_argument("--no-sweep", action="store_true")
    args = p.parse_args()

    dev = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--smoke needs TRITON_INTERPRET=1")
    layers = SMOKE_LAYERS if args.smoke else LAYERS
    token_counts = (17, 64) if args.smoke else (4096, 16384)
    gen = torch.Generator(device=dev).manual_seed(0)
    results = dict(
        device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        checks=[], timing=[], sweep=[],
    )
    out_dir = Path(os.environ.get("OUT", ROOT / "out"))
    out_dir.mkdir(parents=True, exist_ok=True)

    def save():
        (out_dir / "check_backward_gpu.json").write_text(json.dumps(results, indent=1, default=str))

    def on_term(signum, frame):  # `timeout` sends SIGTERM: still print what we have
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)

    def guarded(what, fn, *a):
        try:
            fn(*a)
        except Budget as b:
            log(f"{what}: budget reached at {b}")
        except Exception:
            results.setdefault("errors", []).append(dict(part=what, traceback=traceback.format_exc()))
            log(f"{what} FAILED:\n{traceback.format_exc()}")
        save()

    try:
        results["matmul_peak_tflops"] = matmul_peak(dev)
        log(f"matmul peak {results['matmul_peak_tflops']:.0f} TFLOP/s")
        guarded("checks", run_checks, layers, token_counts, dev, gen, results, args)
        peak = results["matmul_peak_tflops"]
        for lname, shape in layers.items():
            for T in token_counts:
                guarded(f"timing {lname} T={T}", time_layer, lname, shape, T, dev, gen, results, args, peak)
        for lname, shape in layers.items():
            guarded(f"timing {lname} uneven", time_layer, lname, shape, token_counts[-1], dev, gen, results, args,
                    peak, "uneven", False)
        if not args.no_sweep and dev.type == "cuda":
            guarded("sweep", sweep, dev, gen, results, args, layers, token_counts[-1])
        if left(args) > 30 or args.smoke:
            guarded("other dtypes", run_other_dtypes, layers, dev, gen, results)
    except KeyboardInterrupt:
        results["interrupted"] = time.time() - T0
    except Exception:
        results["fatal"] = traceback.format_exc()
        log(results["fatal"])
    finally:
        save()
        print_tables(results)
    bad = any(not c.get("ok") for c in results["checks"])
    if bad or "fatal" in results or "errors" in results:
        sys.exit(1)


if __name__ == "__main__":
    main()
