#!/usr/bin/env python3
"""One MoE layer (transformers' Qwen3-MoE sparse block), moe_fuse beside Inductor and eager: forward and
forward + backward.

    python bench/layer.py [--shapes 30b,235b] [--tokens 4096,16384] [--rounds 5]
                          [--variants eager,inductor,moe_fuse,moe_fuse:ragged_min_rows=0] [--out DIR]
    python bench/layer.py --cpu-smoke       # tiny fp32 block on the CPU, Inductor replaced by aot_eager
    python bench/layer.py --shapes 30b --tokens 1,8,64 --modes fwd \
        --variants inductor,moe_fuse,inductor_graphs,moe_fuse:mode=reduce-overhead     # decode steps
    python bench/layer.py --shapes 30b --tokens 16384 --modes fwd+bwd --free-gib 8  # a card full of other tensors

Each variant is checked against eager on fresh random inputs, then every (variant, mode) is timed, the rows in
turn for --rounds rounds (bench/common.py). A variant ``moe_fuse:name=value`` runs under
``moe_fuse.config.patch(name=value)`` while it compiles and runs. Writes layer_<gpu>.{md,json,png}.
"""
from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the checkout on sys.path)

import torch  # noqa: E402
from moe_fuse import config  # noqa: E402

SHAPES = {  # name: hidden H, moe_intermediate I, experts E, top-k
    "30b": (2048, 768, 128, 8),    # Qwen3-30B-A3B
    "235b": (4096, 1536, 128, 8),  # Qwen3-235B-A22B
    "tiny": (64, 32, 8, 2),        # --cpu-smoke
}
BASES = ["eager", "inductor", "inductor_graphs", "moe_fuse"]  # inductor_graphs: mode="reduce-overhead"
PEER = "inductor"
MODES = ["fwd", "fwd-train", "fwd+bwd"]  # fwd: under no_grad (inference); fwd-train: autograd records
TOL = 2e-2


def build_block(shape, dev, dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    H, I, E, k = SHAPES[shape]
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k,
                         norm_topk_prob=True, hidden_act="silu")
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device(dev):
        block = Qwen3MoeSparseMoeBlock(cfg).to(dtype)
    with torch.no_grad():  # transformers starts the router at zeros: never time on zeros
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block


def compiled(v, block, smoke):
    """The variant's callable (x -> y); the compile happens at its first call."""
    if v.base == "eager":
        return block
    if v.base == "inductor":
        return torch.compile(block, backend="aot_eager" if smoke else "inductor", dynamic=False)
    if v.base == "inductor_graphs":  # CUDA graphs, as moe_fuse:mode=reduce-overhead
        if smoke:
            return torch.compile(block, backend="aot_eager", dynamic=False)
        return torch.compile(block, mode="reduce-overhead", dynamic=False)
    options = {"moe_fuse.inner": "aot_eager"} if smoke else None
    return torch.compile(block, backend=common.moe_fuse_backend(v.settings), dynamic=False, options=options)


def run_case(shape, T, dev, dtype, args, rows):
    """Check every variant, then time every (variant, mode) in turn; rows appended to ``rows``."""
    from moe_fuse.debug import collect_reports

    H, I, E, k = SHAPES[shape]
    print(f"\n=== {shape} (H={H} I={I} E={E} k={k}) T={T} {str(dtype)[6:]} on {dev}", flush=True)
    torch._dynamo.reset()
    block = build_block(shape, dev, dtype)
    params = list(block.parameters())
    names = ["x"] + [n for n, _ in block.named_parameters()]
    gen = torch.Generator().manual_seed(T)
    rand = lambda: torch.randn(1, T, H, generator=gen).to(dev, dtype)  # noqa: E731
    x_chk, g = rand(), rand()
    with torch.no_grad():
        ref_y = block(x_chk)
    xr = x_chk.clone().requires_grad_()
    ref_grads = torch.autograd.grad((block(xr) * g).sum(), [xr] + params)
    x = rand()
    xg = x.clone().requires_grad_()
    leaves = [xg] + params
    # --free-gib: the rest of the card taken by other tensors, as a training job's weights and optimizer state
    fill = []
    if args.free_gib is not None and dev.type == "cuda":
        fill = common.fill_device(dev, args.free_gib)
        print(f"  filled {sum(t.numel() for t in fill) / 2**30:.1f} GiB; "
              f"{common.available_bytes(dev) / 2**30:.1f} GiB free", flush=True)
    case_rows, rewritten = [], {}
    for v in args.variants:
        fn = compiled(v, block, args.cpu_smoke)
        steps = {"fwd": lambda fn=fn: fn(x), "fwd-train": lambda fn=fn: fn(xg),
                 "fwd+bwd": lambda fn=fn: (fn(xg) * g).sum().backward()}
        for mode in args.modes:
            row = dict(shape=shape, T=T, mode=mode, variant=v.name, settings=v.settings, status="ok",
                       flops=6 * T * k * H * I * (3 if mode == "fwd+bwd" else 1))
            case_rows.append(row)
            try:
                if dev.type == "cuda":  # the first call's peak: compiling (and moe_fuse's verification) included
                    torch.cuda.synchronize(dev)
                    torch.cuda.reset_peak_memory_stats(dev)
                    base = torch.cuda.memory_allocated(dev)
                with config.patch(v.settings), collect_reports() as reports:
                    t0 = time.perf_counter()
                    if mode == "fwd":
                        with torch.no_grad():
                            out = fn(x_chk)
                        common.sync(dev)
                        row["err"] = common.rel_err(out, ref_y)
                    elif mode == "fwd-train":
                        out = fn(x_chk.clone().requires_grad_())
                        common.sync(dev)
                        row["err"] = common.rel_err(out, ref_y)
                    else:
                        xc = x_chk.clone().requires_grad_()
                        out = fn(xc)
                        got = torch.autograd.grad((out * g).sum(), [xc] + params)
                        common.sync(dev)
                        row["err"] = common.rel_err(out, ref_y)
                        row["grad_errs"] = {n: common.rel_err(a, b) for n, a, b in zip(names, got, ref_grads)}
                        row["grad_err"] = max(row["grad_errs"].values())
                        del got  # the check's gradients (the size of the weights): not held while others run
                    if v.base != "eager":
                        row["compile_s"] = time.perf_counter() - t0
                if dev.type == "cuda":
                    row["first_call_mb"] = (torch.cuda.max_memory_allocated(dev) - base) / 2**20
                del out
                if v.base == "moe_fuse":  # fwd-train and fwd+bwd share the graph compiled with grad on
                    row["rewrites"] = common.rewrites(reports) or rewritten.get((v.name, mode != "fwd"), [])
                    rewritten[v.name, mode != "fwd"] = row["rewrites"]
                bad = [e for e in (row["err"], row.get("grad_err")) if e is not None and not e <= TOL]
                row["status"] = "FAIL" if bad else "ok"
                step = steps[mode]
                if mode == "fwd":
                    step = torch.no_grad()(step)
                row["step"] = (step, v, leaves if mode == "fwd+bwd" else ())
            except Exception as e:  # an error row; the other variants still run
                tb = traceback.format_exc()
                print("    " + tb[-1500:].replace("\n", "\n    "))
                row.update(status="error", error=f"{type(e).__name__}: {str(e).strip()[:300]}", traceback=tb[-6000:])
            print(f"  {v.name:28s} {mode:8s} {row['status']:5s} err {common.fmt(row.get('err'), '.1e')} "
                  f"grad err {common.fmt(row.get('grad_err'), '.1e')}", flush=True)
            for p in leaves:
                p.grad = None
    timers = {(r["variant"], r["mode"]): (lambda s=r["step"]: _guarded(timed, *s, dev, args))
              for r in case_rows if "step" in r}
    readings = common.in_turn(timers, args.rounds)
    for row in case_rows:
        step = row.pop("step", None)
        if step is None:
            continue
        runs = readings[row["variant"], row["mode"]]
        failed = next((r for r in runs if "error" in r), None)
        if failed is None:
            row["rounds_ms"] = [r["ms"] for r in runs]
            row["ms"] = statistics.median(row["rounds_ms"])
            row["p20"], row["p80"] = runs[0]["p20"], runs[0]["p80"]
            if "power" in runs[0]:
                row["power"] = runs[0]["power"]
            failed = _guarded(measure, row, step, dev, args)
        for p in leaves:
            p.grad = None
        if "error" in failed:  # e.g. out of memory on a full card: this row only, the others still run
            timed_ms = f"timed ({row['ms']:.3f} ms), then " if "ms" in row else ""
            row.update(status="error", error=timed_ms + failed["error"], traceback=failed["traceback"])
            print(f"  {row['variant']:28s} {row['mode']:8s} error: {row['error']}", flush=True)
            continue
        print(f"  {row['variant']:28s} {row['mode']:8s} {row['ms']:9.3f} ms  rounds "
              + " ".join(f"{m:.3f}" for m in row["rounds_ms"]), flush=True)
    rows += case_rows
    del fill


def _guarded(f, *args):
    """f(*args), or {"error", "traceback"} where it raised (what it held freed and the cache emptied first)."""
    try:
        return f(*args)
    except Exception:
        tb = traceback.format_exc()
    print("    " + tb[-1500:].replace("\n", "\n    "))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"error": tb.strip().splitlines()[-1][:300], "traceback": tb[-6000:]}


def measure(row, step, dev, args):
    """The row's memory, host time and allocator churn, after its timing."""
    fn, v, grads = step
    with config.patch(v.settings):
        row["mem_mb"] = common.peak_mem_mb(fn, dev, grads)
        if row["mode"] == "fwd-train":
            row["held_mb"] = common.held_mb(fn, dev)
        if dev.type == "cuda" and row["mode"] == "fwd+bwd":
            queued = common.back_to_back(fn, dev, grads)
            row["host_ms"], row["b2b_ms"] = queued["host_ms"], queued["ms"]
            row["churn"] = common.allocator_churn(fn, dev, grads)
            if args.memory_trace:
                row["peak_sites"] = common.peak_sites(common.record_allocations(fn, dev))
    return {}


def timed(step, v, grads, dev, args):
    with config.patch(v.settings):
        return common.time_ms(step, dev, grad_to_none=grads, power=dev.type == "cuda", **common.timing(args.cpu_smoke))


def derive(rows, peak):
    peer = {(r["shape"], r["T"], r["mode"]): r for r in rows if r["variant"] == PEER and r.get("ms")}
    for r in rows:
        if not r.get("ms"):
            continue
        r["tflops"] = r["flops"] / (r["ms"] * 1e-3) / 1e12
        r["pct_peak"] = 100 * r["tflops"] / peak["tflops"]
        p = peer.get((r["shape"], r["T"], r["mode"]))
        r["x_inductor"] = p["ms"] / r["ms"] if p else None
        if p and p.get("b2b_ms") and r.get("b2b_ms"):
            r["x_inductor_b2b"] = p["b2b_ms"] / r["b2b_ms"]
        if p and len(r["rounds_ms"]) > 1:
            r["x_inductor_rounds"] = [a / b for a, b in zip(p["rounds_ms"], r["rounds_ms"])]


def markdown(rows, peak, meta, rounds):
    f = common.fmt
    lines = [f"# layer: one Qwen3-MoE sparse block, {meta['dtype']}", "", common.header(meta), "",
             f"ms: median of {rounds} round(s) of timing, the rows in turn. TFLOP/s count 6 T k H I forward, 3x that "
             f"forward + backward (the router not counted); % of the {peak['n']}^3 matmul measured in the same run "
             f"({peak['tflops']:.1f} TFLOP/s). x inductor = Inductor's ms / this ms. err / grad err: relative to "
             f"eager (the output; the worst gradient of x and every parameter). mem: peak MB one call allocates; held: "
             f"what the training forward (fwd-train) holds until its backward, output included; first call: the peak "
             f"MB of the first call, compiling included. queued: one fwd+bwd step's share of 10 issued back to back "
             f"(no flush, no synchronize between: the rate of layers queued one after another), and Inductor's over "
             f"it. mallocs / retries: cudaMalloc calls and the allocator's free-the-cache-and-retry events per fwd+bwd "
             f"step (0 in a steady step)."
             + (f" The card was filled with other tensors to leave {meta['free_gib']} GiB free before each case."
                if meta.get("free_gib") is not None else ""), ""]
    table = []
    for r in rows:
        if r["status"] == "error":
            table.append([r["shape"], r["T"], r["mode"], r["variant"], "error", r["error"][:120]] + [None] * 13)
            continue
        table.append([r["shape"], r["T"], r["mode"], r["variant"], r["status"], f(r.get("ms"), ".3f"),
                      f(r.get("tflops"), ".1f"), f(r.get("pct_peak"), ".1f"), f(r.get("x_inductor"), ".2f"),
                      f(r.get("mem_mb"), ".0f"), f(r.get("held_mb"), ".0f"), f(r.get("first_call_mb"), ".0f"),
                      f(r.get("host_ms"), ".3f"), f(r.get("b2b_ms"), ".3f"), f(r.get("x_inductor_b2b"), ".2f"),
                      _churn(r.get("churn")),
                      f(r.get("compile_s"), ".1f"), f(r.get("err"), ".1e"), f(r.get("grad_err"), ".1e")])
    lines.append(common.md_table(["shape", "T", "mode", "variant", "status", "ms", "TFLOP/s", "% peak",
                                  "x inductor", "mem MB", "held MB", "first call MB", "host ms", "queued ms",
                                  "x inductor queued", "mallocs / retries", "compile s", "err", "grad err"],
                                 table))
    by_round = [r for r in rows if r.get("x_inductor_rounds") and r["variant"] != PEER]
    if by_round:
        lines += ["", "x inductor by round:", ""]
        lines += [f"- {r['shape']} T={r['T']} {r['mode']} {r['variant']}: "
                  + " ".join(f"{x:.3f}" for x in r["x_inductor_rounds"]) for r in by_round]
    host_bound = [r for r in rows if r.get("host_ms") and r["host_ms"] >= 0.9 * r["ms"]]
    if host_bound:
        lines += ["", "Host-bound (the host took at least 0.9x the step's ms to issue it; the reading follows the CPU): "
                  + ", ".join(f"{r['shape']} T={r['T']} {r['variant']}" for r in host_bound)]
    rewritten = {r["variant"]: r["rewrites"] for r in rows if r.get("rewrites")}
    if rewritten:
        lines += ["", "moe_fuse rewrites: " + "; ".join(f"{v}: {', '.join(p)}" for v, p in rewritten.items())]
    return "\n".join(lines)


def _churn(c):
    return "-" if not c else f"{c['mallocs']:g} / {c['retries']:g}"


def plot(rows, peak):
    def draw(plt):
        modes = [m for m in MODES if any(r["mode"] == m and r.get("ms") for r in rows)]
        if not modes:
            return
        fig, axes = plt.subplots(1, len(modes), figsize=(7 * len(modes), 4.5), squeeze=False)
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        for ax, mode in zip(axes[0], modes):
            cases = list(dict.fromkeys((r["shape"], r["T"]) for r in rows if r["mode"] == mode))
            w = 0.8 / len(variants)
            for i, v in enumerate(variants):
                rs = [next((r for r in rows if (r["shape"], r["T"], r["mode"], r["variant"]) == (*c, mode, v)), {})
                      for c in cases]
                bars = ax.bar([j + i * w for j in range(len(cases))], [r.get("tflops") or 0 for r in rs], w, label=v)
                ax.bar_label(bars, [f"{r['ms']:.2f} ms" if r.get("ms") else r.get("status", "") for r in rs],
                             fontsize=6, rotation=90, padding=2)
            ax.axhline(peak["tflops"], ls="--", c="k", lw=0.8, label="matmul peak")
            ax.set_xticks([j + 0.4 - w / 2 for j in range(len(cases))], [f"{s}\nT={T}" for s, T in cases])
            ax.set_ylabel("TFLOP/s (6 T k H I per forward)")
            ax.set_title(mode)
            ax.legend(fontsize=7)
    return draw


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="30b,235b", help=f"of {', '.join(s for s in SHAPES if s != 'tiny')}")
    ap.add_argument("--tokens", default="4096,16384", help="T, tokens of the one sequence (x is [1, T, H])")
    ap.add_argument("--variants", default="eager,inductor,moe_fuse",
                    help="of eager, inductor, moe_fuse; moe_fuse:name=value[:name=value] runs it under those "
                         "moe_fuse.config settings")
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    ap.add_argument("--rounds", type=int, default=1, help="time every row this many times, the rows in turn")
    ap.add_argument("--memory-trace", action="store_true",
                    help="CUDA: record one fwd+bwd step's allocations and list what is live at its peak")
    ap.add_argument("--free-gib", type=float, default=None,
                    help="CUDA: before each case fill the card with other tensors, leaving this many GiB free (a "
                         "job's weights and optimizer state take most of a real card)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny fp32 block on the CPU (checks the script)")
    ap.add_argument("--out", default=str(common.RESULTS), help="folder for layer_<gpu>.{md,json,png}")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.free_gib is not None and args.free_gib <= 0:
        ap.error(f"--free-gib must be positive, got {args.free_gib}")
    try:
        args.variants = common.parse_variants(args.variants, BASES)
    except ValueError as e:
        ap.error(str(e))
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or set(args.modes) - set(MODES):
        ap.error(f"--modes takes {', '.join(MODES)}")
    if args.cpu_smoke:
        args.shapes, args.tokens = ["tiny"], [64]
    else:
        args.shapes = [s for s in args.shapes.split(",") if s]
        if set(args.shapes) - set(SHAPES):
            ap.error(f"unknown shapes {sorted(set(args.shapes) - set(SHAPES))}")
        args.tokens = [int(t) for t in args.tokens.split(",") if t]
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.cpu_smoke:
        dev, dtype = torch.device("cpu"), torch.float32
    elif torch.cuda.is_available():
        dev, dtype = torch.device("cuda"), torch.bfloat16
    else:
        sys.exit("no CUDA device: use --cpu-smoke")
    common.compile_setup()
    meta = dict(common.provenance(dev), dtype=str(dtype).replace("torch.", ""), rounds=args.rounds,
                free_gib=args.free_gib if dev.type == "cuda" else None)
    peak = common.matmul_peak(dev, dtype)
    print(f"layer: {common.header(meta)}\nmatmul peak {peak['tflops']:.1f} TFLOP/s", flush=True)
    rows = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("SIGTERM: writing what was measured"))
    try:
        for shape in args.shapes:
            for T in args.tokens:
                try:
                    run_case(shape, T, dev, dtype, args, rows)
                except Exception as e:  # e.g. out of memory building the block
                    traceback.print_exc()
                    rows.append(dict(shape=shape, T=T, mode="-", variant="(case)", status="error",
                                     error=f"{type(e).__name__}: {e}"[:300]))
    finally:  # a run cut short still writes what it measured
        derive(rows, peak)
        md = markdown(rows, peak, meta, args.rounds)
        print("\n" + md)
        common.write_results("layer", dev, args.out, dict(meta=meta, peak=peak, rows=rows), md, plot(rows, peak))
    return 1 if any(r["status"] in ("FAIL", "error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
