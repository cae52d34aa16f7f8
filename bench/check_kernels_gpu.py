#!/usr/bin/env python3
"""Check and time the Triton experts forward (moe_fuse.kernels) on a GPU.

    cd <repo> && PYTHONPATH=. python3 bench/check_kernels_gpu.py [--sweep] [--inductor] [--budget-s 240]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/check_kernels_gpu.py --smoke     # CPU, tiny shapes

1. correctness at real sizes (Qwen3-30B-A3B and -235B-A22B expert layers,
   T in {1, 4096, 16384}, uneven routing with empty experts), bf16, against
   reference.experts_forward in fp32 on a sample of 512 tokens (each token's
   output depends on that token alone, so a sample is an exact check of those
   rows); every buffer the kernels allocate is poisoned with NaN first; the
   run is repeated and must be bitwise equal. Then other dtypes, mixed dtypes,
   non-contiguous x and expert-parallel sentinels at a smaller T.
2. timing (triton.testing.do_bench, median) on balanced routing: the kernel
   forward and its stages, the reference, the two bare torch._grouped_mm GEMMs
   (inputs pre-sorted, outside the timing) and, with --inductor, transformers'
   grouped_mm experts path compiled by Inductor. TFLOP/s count 6*T*k*H*I;
   % peak is against an 8192^3 bf16 torch.matmul measured here.
3. --sweep (run before the timing, stopped at 60% of --budget-s): each GEMM
   alone over a list of block configurations at T=16384.

Prints tables last; writes everything to $OUT/check_kernels_gpu.json (or ./out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from moe_fuse import reference  # noqa: E402
from moe_fuse.kernels import experts_forward, route  # noqa: E402
from moe_fuse.kernels.combine import combine  # noqa: E402
from moe_fuse.kernels.grouped_gemm import GemmConfig, default_config, down, gate_up  # noqa: E402

LAYERS = {  # name: (H, I, E, k)
    "30B-A3B": (2048, 768, 128, 8),
    "235B-A22B": (4096, 1536, 128, 8),
}
SMOKE_LAYERS = {"tiny": (40, 24, 6, 2)}

# Sweeps per token count: (gate_up configs, down configs); the first of each list is the default.
# Run 1 (bench/KERNELS_NOTES.md) compared pointer loads, TMA, tile shapes and stages; these
# explore around the chosen defaults.
SWEEPS = {
    16384: (
        [
            GemmConfig(128, 128, 64, 8, 8, 3, use_tma=True),
            GemmConfig(128, 128, 64, 4, 8, 3, use_tma=True),
            GemmConfig(128, 128, 64, 16, 8, 3, use_tma=True),
            GemmConfig(128, 128, 128, 8, 8, 2, use_tma=True),
            GemmConfig(256, 64, 64, 8, 8, 3, use_tma=True),
            GemmConfig(256, 128, 64, 8, 16, 3, use_tma=True),
        ],
        [
            GemmConfig(128, 256, 64, 8, 8, 3, use_tma=True),
            GemmConfig(128, 256, 64, 8, 8, 4, use_tma=True),
            GemmConfig(128, 256, 64, 4, 8, 3, use_tma=True),
            GemmConfig(128, 256, 64, 16, 8, 3, use_tma=True),
            GemmConfig(256, 128, 64, 8, 8, 3, use_tma=True),
            GemmConfig(128, 256, 128, 8, 8, 2, use_tma=True),
            GemmConfig(256, 256, 64, 8, 16, 3, use_tma=True),
        ],
    ),
    1: (
        [GemmConfig(16, 32, 128, 1, 4, 4), GemmConfig(16, 64, 128, 1, 4, 4), GemmConfig(16, 32, 256, 1, 4, 3)],
        [GemmConfig(16, 64, 128, 1, 4, 4), GemmConfig(16, 32, 128, 1, 4, 4), GemmConfig(16, 128, 128, 1, 4, 4)],
    ),
}

T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def cfg_str(c: GemmConfig) -> str:
    s = f"{c.block_m}x{c.block_n}x{c.block_k} g{c.group_m} w{c.num_warps} s{c.num_stages}"
    return s + (" tma" if c.use_tma else "")


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@contextlib.contextmanager
def poisoned_buffers():
    """Every torch.empty inside (the kernels' buffers) starts as NaN / -1: unwritten elements show."""
    real_empty = torch.empty

    def poisoned_empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        t.fill_(float("nan") if t.is_floating_point() else -1)
        return t

    torch.empty = poisoned_empty
    try:
        yield
    finally:
        torch.empty = real_empty


# --------------------------------------------------------------------------- inputs


def make_weights(H, I, E, dtype, dev, gen):
    w_gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=dtype, generator=gen).mul_(H**-0.5)
    w_down = torch.randn(E, H, I, device=dev, dtype=dtype, generator=gen).mul_(I**-0.5)
    return w_gate_up, w_down


def make_tokens(T, H, E, k, routing, dtype, dev, gen, r_dtype=None):
    x = torch.randn(T, H, device=dev, dtype=dtype, generator=gen)
    if routing == "balanced":
        # Exactly T*k/E rows per expert when E divides T: token t takes experts t + j*E/k (mod E),
        # then tokens and expert labels are shuffled.
        base = (torch.arange(T, device=dev)[:, None] + torch.arange(k, device=dev)[None, :] * (E // k)) % E
        relabel = torch.randperm(E, device=dev, generator=gen)
        ids = relabel[base][torch.randperm(T, device=dev, generator=gen)]
    elif routing == "uneven":
        # Zipf-like popularity, and every 16th expert never chosen.
        p = 1.0 / (torch.randperm(E, device=dev, generator=gen).double() + 1.0) ** 1.1
        p[::16] = 0
        ids = torch.multinomial(p.expand(T, E).float(), k, replacement=False, generator=gen)
    else:
        raise ValueError(routing)
    scores = torch.rand(T, k, device=dev, generator=gen) + 0.05
    weights = (scores / scores.sum(-1, keepdim=True)).to(r_dtype or dtype)
    return x, ids, weights


PROBE_LAYERS = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8)}  # --case names: (H, I, E, k)


def balanced_case(case: str, dev, seed: int = 0):
    """A probe's --case ("30b:16384") as bf16 weights and tokens with balanced routing:
    (T, H, I, E, k, gen, w_gate_up, w_down, x, ids, weights)."""
    layer, T = case.split(":")
    T = int(T)
    H, I, E, k = PROBE_LAYERS[layer]
    gen = torch.Generator(device=dev).manual_seed(seed)
    w_gate_up, w_down = make_weights(H, I, E, torch.bfloat16, dev, gen)
    x, ids, weights = make_tokens(T, H, E, k, "balanced", torch.bfloat16, dev, gen)
    return T, H, I, E, k, gen, w_gate_up, w_down, x, ids, weights


# --------------------------------------------------------------------------- timing


def bench_ms(fn, dev, rep=100) -> float:
    if dev.type == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return sorted(ts)[1]


def matmul_peak(dev) -> float:
    if dev.type != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b, dev, rep=300)
    return 2 * 8192**3 / ms / 1e9


def grouped_mm_fn():
    return getattr(F, "grouped_mm", None) or torch._grouped_mm


def transformers_like(x, ids, weights, w_gate_up, w_down):
    """transformers 5.x grouped_mm_experts_forward, the experts part (to compile with Inductor)."""
    T, H = x.shape
    k = ids.shape[1]
    E = w_gate_up.shape[0]
    gmm = grouped_mm_fn()
    expert_ids_g, perm = torch.sort(ids.reshape(-1))
    xs = x[perm // k]
    sw = weights.reshape(-1)[perm]
    counts = torch.histc(expert_ids_g.int(), bins=E, min=0, max=E - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = gmm(xs.to(w_gate_up.dtype), w_gate_up.transpose(-2, -1), offs=offsets)
    gate, up = h.chunk(2, dim=-1)
    out = gmm(F.silu(gate) * up, w_down.transpose(-2, -1), offs=offsets)
    weighted = out * sw.unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=x.device)
    return weighted[inv].view(T, k, H).sum(dim=1).to(x.dtype)


# --------------------------------------------------------------------------- checks


def check_case(name, *args, **kwargs):
    try:
        return _check_case(name, *args, **kwargs)
    except Exception:
        log(f"check {name} FAILED:\n{traceback.format_exc()}")
        return dict(case=name, T=args[0].shape[0], err=float("nan"), ref_lowp_err=float("nan"), ok=False,
                    error=traceback.format_exc()[-2000:])


def _check_case(name, x, ids, weights, w_gate_up, w_down, w32, dev, gen, sample=512, tol=1.5e-2):
    T = x.shape[0]
    with poisoned_buffers():
        y = experts_forward(x, ids, weights, w_gate_up, w_down)
    y2 = experts_forward(x, ids, weights, w_gate_up, w_down)
    finite = bool(torch.isfinite(y).all())
    deterministic = bool(torch.equal(y, y2))
    idx = torch.randperm(T, device=dev, generator=gen)[:sample] if T > sample else torch.arange(T, device=dev)
    wgu32, wd32 = w32 if w32 is not None else (w_gate_up.float(), w_down.float())
    ref = reference.experts_forward(x[idx].float(), ids[idx], weights[idx].float(), wgu32, wd32)
    err = rel_err(y[idx], ref)
    # The reference in the inputs' own dtypes: how far plain PyTorch lands from fp32.
    ref_lp_err = rel_err(reference.experts_forward(x[idx], ids[idx], weights[idx], w_gate_up, w_down), ref)
    ok = finite and deterministic and err < tol
    row = dict(case=name, T=T, err=err, ref_lowp_err=ref_lp_err, finite=finite, deterministic=deterministic, ok=ok)
    log(f"check {name}: err {err:.2e} (reference in own dtype {ref_lp_err:.2e}) finite={finite} "
        f"deterministic={deterministic} -> {'OK' if ok else 'FAIL'}")
    return row


def run_checks(layers, token_counts, dev, gen, results):
    for lname, (H, I, E, k) in layers.items():
        w_gate_up, w_down = make_weights(H, I, E, torch.bfloat16, dev, gen)
        w32 = (w_gate_up.float(), w_down.float())
        for T in token_counts:
            x, ids, weights = make_tokens(T, H, E, k, "uneven", torch.bfloat16, dev, gen)
            results["checks"].append(check_case(f"{lname} bf16 uneven", x, ids, weights, w_gate_up, w_down, w32, dev, gen))
        del w32
    # Other dtypes and layouts, at the 30B shape (or the smoke shape) and a smaller T.
    lname, (H, I, E, k) = next(iter(layers.items()))
    T = 512 if dev.type == "cuda" else 24
    for dtype, tol in ((torch.float16, 5e-3), (torch.float32, 1e-4)):
        wgu, wd = make_weights(H, I, E, dtype, dev, gen)
        x, ids, weights = make_tokens(T, H, E, k, "uneven", dtype, dev, gen)
        results["checks"].append(check_case(f"{lname} {str(dtype)[6:]}", x, ids, weights, wgu, wd, None, dev, gen, tol=tol))
    wgu, wd = make_weights(H, I, E, torch.bfloat16, dev, gen)
    x, ids, weights = make_tokens(T, H, E, k, "uneven", torch.float32, dev, gen, r_dtype=torch.bfloat16)
    results["checks"].append(check_case(f"{lname} x fp32, weights bf16", x, ids, weights, wgu, wd, None, dev, gen))
    x, ids, weights = make_tokens(T, H, E, k, "uneven", torch.bfloat16, dev, gen, r_dtype=torch.float32)
    results["checks"].append(check_case(f"{lname} routing fp32", x, ids, weights, wgu, wd, None, dev, gen))
    x_nc = torch.empty(T, 2 * H, device=dev, dtype=torch.bfloat16)[:, ::2]
    x_nc.copy_(x)
    results["checks"].append(check_case(f"{lname} non-contiguous x", x_nc, ids, weights, wgu, wd, None, dev, gen))
    off_rank = torch.rand(ids.shape, device=dev, generator=gen) < 0.25
    ids_ep = torch.where(off_rank, torch.full_like(ids, E), ids)
    results["checks"].append(check_case(f"{lname} EP sentinels", x, ids_ep, weights, wgu, wd, None, dev, gen))


# --------------------------------------------------------------------------- timing


def time_layer(lname, shape, T, dev, gen, results, args, peak):
    H, I, E, k = shape
    flops = 6 * T * k * H * I
    w_gate_up, w_down = make_weights(H, I, E, torch.bfloat16, dev, gen)
    x, ids, weights = make_tokens(T, H, E, k, "balanced", torch.bfloat16, dev, gen)
    rows = {}

    def add(name, ms, f=flops):
        tflops = f / ms / 1e9
        rows[name] = dict(ms=ms, tflops=tflops, pct_peak=100 * tflops / peak if peak == peak else float("nan"))

    add("kernels forward", bench_ms(lambda: experts_forward(x, ids, weights, w_gate_up, w_down), dev))
    if dev.type == "cuda" and T <= 64:
        # Decode: launch overhead dominates; under a CUDA graph it goes away.
        try:
            ms = triton.testing.do_bench_cudagraph(
                lambda: experts_forward(x, ids, weights, w_gate_up, w_down), rep=50, return_mode="median")
            add("kernels forward (CUDA graph)", ms)
        except Exception as e:
            log(f"CUDA graph timing failed: {e!r}")
    routing = route(ids, E)
    a, _ = gate_up(x, routing, w_gate_up, k)
    slots = down(a, routing, weights, w_down, torch.bfloat16)
    add("  route", bench_ms(lambda: route(ids, E), dev), 0)
    add("  gate_up", bench_ms(lambda: gate_up(x, routing, w_gate_up, k), dev), 4 * T * k * H * I)
    add("  down", bench_ms(lambda: down(a, routing, weights, w_down, torch.bfloat16), dev), 2 * T * k * H * I)
    add("  combine", bench_ms(lambda: combine(slots, ids, E, torch.bfloat16), dev), 0)
    if T >= 64:
        add("reference (eager loop)", bench_ms(lambda: reference.experts_forward(x, ids, weights, w_gate_up, w_down), dev))
    if dev.type == "cuda" and T >= 64:
        gmm = grouped_mm_fn()
        order = routing.order.long()
        xs = x[order // k].contiguous()
        offs = routing.offsets[1:].contiguous()
        wgu_t, wd_t = w_gate_up.transpose(-2, -1), w_down.transpose(-2, -1)
        a_s = torch.randn(T * k, I, device=dev, dtype=torch.bfloat16, generator=gen)
        add("2x torch._grouped_mm", bench_ms(lambda: (gmm(xs, wgu_t, offs=offs), gmm(a_s, wd_t, offs=offs)), dev))
        if args.inductor and T >= 16384 and time.time() - T0 < args.budget_s:
            try:
                fn = torch.compile(transformers_like, dynamic=False)
                y_ind = fn(x, ids, weights, w_gate_up, w_down)
                y_k = experts_forward(x, ids, weights, w_gate_up, w_down)
                rows_err = rel_err(y_k, y_ind)
                add("transformers grouped_mm + Inductor", bench_ms(lambda: fn(x, ids, weights, w_gate_up, w_down), dev))
                rows["transformers grouped_mm + Inductor"]["err_vs_kernels"] = rows_err
            except Exception as e:  # a baseline failing must not lose the rest of the run
                log(f"inductor baseline failed: {e!r}")
    results["timing"].append(dict(layer=lname, T=T, rows=rows))
    log(f"timed {lname} T={T}: " + ", ".join(f"{n.strip()} {r['ms']:.3f}" for n, r in rows.items()))
    return w_gate_up, w_down


def sweep_layer(lname, shape, T, dev, gen, results, args):
    H, I, E, k = shape
    w_gate_up, w_down = make_weights(H, I, E, torch.bfloat16, dev, gen)
    x, ids, weights = make_tokens(T, H, E, k, "balanced", torch.bfloat16, dev, gen)
    routing = route(ids, E)
    a_ref, _ = gate_up(x, routing, w_gate_up, k)
    s_ref = down(a_ref, routing, weights, w_down, torch.bfloat16)
    gate_up_configs, down_configs = SWEEPS[T]
    for kind, configs, flops in (("gate_up", gate_up_configs, 4 * T * k * H * I), ("down", down_configs, 2 * T * k * H * I)):
        for cfg in configs:
            if time.time() - T0 > 0.6 * args.budget_s:
                log("budget reached: sweep stopped")
                return
            row = dict(layer=lname, T=T, kind=kind, config=cfg_str(cfg))
            try:
                if kind == "gate_up":
                    fn = lambda: gate_up(x, routing, w_gate_up, k, config=cfg)  # noqa: E731
                    err = rel_err(fn()[0], a_ref)
                else:
                    fn = lambda: down(a_ref, routing, weights, w_down, torch.bfloat16, config=cfg)  # noqa: E731
                    err = rel_err(fn(), s_ref)
                ms = bench_ms(fn, dev)
                row.update(ms=ms, tflops=flops / ms / 1e9, err_vs_default=err)
            except Exception as e:
                row.update(error=repr(e)[:300])
            results["sweep"].append(row)
            log("sweep", row)


# --------------------------------------------------------------------------- main


def guarded(what, results, fn, *args):
    """Run one part; a failure is recorded and the rest of the run goes on."""
    try:
        fn(*args)
    except Exception:
        results.setdefault("errors", []).append(dict(part=what, traceback=traceback.format_exc()))
        log(f"{what} FAILED:\n{traceback.format_exc()}")


def print_tables(results):
    peak = results["matmul_peak_tflops"]
    print()
    print(f"device: {results['device']}; bf16 matmul 8192^3: {peak:.0f} TFLOP/s")
    print("\n== correctness (rel. norm vs fp32 reference) ==")
    for c in results["checks"]:
        print(f"{c['case']:<34} T={c['T']:<6} err {c['err']:.2e}  ref-own-dtype {c['ref_lowp_err']:.2e}  "
              f"{'OK' if c['ok'] else 'FAIL'}")
    print("\n== timing, balanced routing, bf16 (median ms; TFLOP/s on 6*T*k*H*I, stages on their own FLOPs) ==")
    for t in results["timing"]:
        print(f"-- {t['layer']} T={t['T']}")
        for name, r in t["rows"].items():
            print(f"   {name:<36} {r['ms']:9.3f} ms  {r['tflops']:7.1f} TFLOP/s  {r['pct_peak']:5.1f}% peak")
    if results["sweep"]:
        print("\n== sweep (each GEMM alone; err vs the default config's output) ==")
        for s in results["sweep"]:
            head = f"{s['layer']:<10} T={s['T']:<6} {s['kind']:<8} {s['config']:<32}"
            if "error" in s:
                print(f"{head} ERROR {s['error'][:80]}")
            else:
                print(f"{head} {s['ms']:7.3f} ms {s['tflops']:6.1f} TFLOP/s err {s['err_vs_default']:.1e}")
    for e in results.get("errors", []):
        print(f"ERROR in {e['part']}: {e['traceback'].splitlines()[-1]}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--inductor", action="store_true")
    p.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes")
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--skip-checks", action="store_true")
    args = p.parse_args()

    dev = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--smoke needs TRITON_INTERPRET=1")
    layers = SMOKE_LAYERS if args.smoke else LAYERS
    token_counts = (1, 17, 64) if args.smoke else (1, 4096, 16384)
    gen = torch.Generator(device=dev).manual_seed(0)
    results = dict(
        device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        checks=[], timing=[], sweep=[], defaults={},
    )
    results["matmul_peak_tflops"] = matmul_peak(dev)
    log(f"matmul peak {results['matmul_peak_tflops']:.0f} TFLOP/s")
    for lname, (H, I, E, k) in layers.items():
        for T in token_counts:
            S = T * k
            results["defaults"][f"{lname} T={T}"] = dict(
                gate_up=cfg_str(default_config("gate_up", S, E, I, H, torch.bfloat16)),
                down=cfg_str(default_config("down", S, E, H, I, torch.bfloat16)),
            )

    out_dir = Path(os.environ.get("OUT", ROOT / "out"))
    out_dir.mkdir(parents=True, exist_ok=True)

    def save():
        (out_dir / "check_kernels_gpu.json").write_text(json.dumps(results, indent=1, default=str))

    try:
        if not args.skip_checks:
            run_checks(layers, token_counts, dev, gen, results)
            save()
        if args.sweep and dev.type == "cuda":  # before the timing table, but stopped at 60% of the budget
            for lname, shape in layers.items():
                for T in SWEEPS:
                    guarded(f"sweep {lname} T={T}", results, sweep_layer, lname, shape, T, dev, gen, results, args)
                    save()
        for lname, shape in layers.items():
            for T in token_counts:
                guarded(f"timing {lname} T={T}", results, time_layer, lname, shape, T, dev, gen, results, args,
                        results["matmul_peak_tflops"])
                save()
    except Exception:
        results["fatal"] = traceback.format_exc()
        log(results["fatal"])
    finally:
        save()
        print_tables(results)
    if any(not c["ok"] for c in results["checks"]) or "fatal" in results or "errors" in results:
        sys.exit(1)


if __name__ == "__main__":
    main()
