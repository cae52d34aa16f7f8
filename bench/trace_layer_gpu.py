#!/usr/bin/env python3
"""Probe: the kernel sequence of one compiled MoE layer step (forward + backward), kernel by kernel.

    PYTHONPATH=. python3 bench/trace_layer_gpu.py [--shape 30b] [--tokens 16384] [--order inductor,moe_fuse,inductor]

For each backend in --order (the same block, input and dy; a name may repeat, to see drift from
the card's state), one step is traced with torch.profiler and every CUDA kernel of it is listed:
start offset, duration, stream, name. GEMM sums per backend at the end. Also prints the SM clock and
power that nvidia-smi reports before each trace (read only). --no-overlap: the all-Triton backward's
weight gradients on one stream (the grouped_mm path always uses one). --paced: whether the card
slows down under sustained load (power, clocks), and the GPU's idle time between back-to-back steps.
--sustain S: S seconds of steps right before each trace, so the trace shows the card at its power
limit. --order takes "moe_fuse_cutlass" and "moe_fuse_ragged" too: moe_fuse with
the row-ragged GEMMs through torch._grouped_mm, or through kernels/ragged_gemm.py, at every size. --power: each backend's step run back to back with nvidia-smi samples of the SM clock, power
and whether the software power cap is active (bench/power.py).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_bench import SHAPES, build_block, ensure_moe_fuse_backend, gemms_setup  # noqa: E402
from host_profile import layer_step  # noqa: E402
from power import run_sustained  # noqa: E402


def smi():
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        out = f"nvidia-smi: {e}"
    return out


def trace_kernels(step, iters=3, idle_ms=0.0, every=False):
    """The last step's kernels (every: a list of each step's kernels); idle_ms > 0: synchronize and
    sleep that long between steps (the GPU idles), else steps are issued back to back."""
    import time

    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
            if idle_ms:
                torch.cuda.synchronize()
                time.sleep(idle_ms / 1e3)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    per = len(kernels) // iters
    if every:
        return [kernels[i * per : (i + 1) * per] for i in range(iters)]
    return kernels[-per:]


def span_ms(kernels):
    return (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) / 1e3


def host_check(step, n=20):
    """(enqueue ms per step, period ms per step) over n steps issued back to back; and the
    synchronizing calls one step makes (torch.cuda.set_sync_debug_mode)."""
    import time
    import warnings

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(n):
        step()
    t1 = time.perf_counter()
    end.record()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = sorted({str(w.message).splitlines()[0][:120] for w in caught if "called a synchronizing" in str(w.message)})
    return (t1 - t0) * 1e3 / n, start.elapsed_time(end) / n, syncs


# moe_fuse with kernel switches of grouped_mm_path flipped ((attribute, value), ...), read at every call of
# the experts op
SWITCHED = {
    "moe_fuse_cutlass": (("RAGGED_TRITON", False),),  # row-ragged GEMMs in torch
    "moe_fuse_ragged": (("RAGGED_MIN_ROWS", 0),),  # ragged_gemm at every size
    "moe_fuse_gluon": (("GLUON", True),),  # the plain Gluon GEMMs
    "moe_fuse_gluon_fused": (("GLUON_SWIGLU", True), ("GLUON_DSWIGLU", True)),  # SwiGLU / dSwiGLU fused
    # gate_up with SwiGLU fused, dgrad and dx plain Gluon; down (ragged_gemm) and the dSwiGLU pass as default
    "moe_fuse_gluon_fwd": (("GLUON", True), ("GLUON_SWIGLU", True)),
}


def switches(name):
    """SWITCHED[name], or for "moe_fuse@ATTR=VALUE@..." those grouped_mm_path attributes (ints, None, True,
    False); "MODULE.ATTR" names an attribute of another moe_fuse.kernels module."""
    if name in SWITCHED:
        return SWITCHED[name]
    parsed = []
    for item in name.split("@")[1:]:
        attr, value = item.split("=")
        parsed.append((attr, {"None": None, "True": True, "False": False}.get(value) if value in ("None", "True", "False")
                       else int(value)))
    return tuple(parsed)


def backend_step(name, block, x, dy, params, compiled):
    """One layer step under backend ``name``, or under moe_fuse with a SWITCHED kernel switch. The first
    time a switched step and moe_fuse's both exist, their gradients are compared bitwise."""
    if name not in SWITCHED and "@" not in name:
        return layer_step(torch.compile(block, backend=name), x, dy, params)
    import importlib

    def target(attr):  # (module, attribute name)
        mod, _, attr = attr.rpartition(".")
        return importlib.import_module(f"moe_fuse.kernels.{mod or 'grouped_mm_path'}"), attr

    inner = layer_step(torch.compile(block, backend="moe_fuse"), x, dy, params)

    def step():
        before = [(*target(attr), getattr(*target(attr))) for attr, _ in switches(name)]
        for attr, value in switches(name):
            setattr(*target(attr), value)
        try:
            inner()
        finally:
            for module, attr, value in before:
                setattr(module, attr, value)

    if "moe_fuse" in compiled:
        got = []
        for run in (compiled["moe_fuse"], step):
            run()
            got.append([p.grad.clone() for p in params])
        same = all(torch.equal(a, b) for a, b in zip(*got))
        print(f"== moe_fuse vs {name}: gradients of x and every parameter bitwise equal: {same}", flush=True)
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="30b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--order", default="inductor,moe_fuse,inductor,moe_fuse")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--paced", action="store_true", help="also: kernel spans back to back vs with idle gaps")
    ap.add_argument("--sustain", type=float, default=0.0,
                    help="run each step back to back this many seconds right before its trace (the card at its "
                         "power limit)")
    ap.add_argument("--power", action="store_true",
                    help="only: each backend's step (and 'gemms', the six grouped GEMMs alone) for 4 s back to "
                         "back, with SM clock, power and power-cap samples")
    args = ap.parse_args()
    ensure_moe_fuse_backend()
    if args.no_overlap:
        from moe_fuse.kernels import backward

        backward.OVERLAP_WGRAD = False
    block = build_block(args.shape, "cuda", torch.bfloat16)
    x = torch.randn(1, args.tokens, SHAPES[args.shape][0], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    params = [x, *block.parameters()]
    if args.power:
        run, xs, a, w1, w2, _ = gemms_setup(block, args.tokens, "cuda", torch.bfloat16, True)
        outs = run()
        gs = [torch.randn_like(o) for o in outs]
        leaves = [xs, a, block.experts.gate_up_proj, block.experts.down_proj]

        def gemms_step():  # the layer's six grouped GEMMs (forward and backward), nothing else
            for p in leaves:
                p.grad = None
            torch.autograd.backward(list(run()), gs)

        compiled = {"gemms": gemms_step}
        for name in args.order.split(","):
            if name not in compiled:
                compiled[name] = backend_step(name, block, x, dy, params, compiled)
            step = compiled[name]
            med = do_bench(step, warmup=20, rep=200, return_mode="median")
            ms, smp = run_sustained(step, 4.0)
            print(f"== {name}: do_bench median {med:.3f} ms; {ms:.3f} ms/step over 4 s; {smp.summary()}", flush=True)
        return
    compiled = {}
    for name in args.order.split(","):
        if name not in compiled:
            compiled[name] = backend_step(name, block, x, dy, params, compiled)
        step = compiled[name]

        ms = do_bench(step, warmup=20, rep=200, return_mode="median")
        enq, period, syncs = host_check(step)
        print(f"== {name}: host enqueue {enq:.3f} ms/step, back-to-back period {period:.3f} ms/step, syncs: {syncs}")
        if args.sustain:
            run_sustained(step, args.sustain, idle_first=False)
        before = smi()
        kernels = trace_kernels(step)
        t0 = kernels[0]["ts"]
        print(f"== {name}: step {ms:.3f} ms; nvidia-smi (sm MHz, W, C): {before}")
        gemm = 0.0
        for e in kernels:
            kname = e["name"]
            short = "CUTLASS grouped GEMM" if "cutlass" in kname else kname[:70]
            if "cutlass" in kname:
                gemm += e["dur"]
            print(f"  {(e['ts'] - t0) / 1e3:7.3f} +{e['dur'] / 1e3:6.3f} ms  s{e.get('args', {}).get('stream', '?'):<3} {short}")
        print(f"  span {span_ms(kernels):.3f} ms, kernels {sum(e['dur'] for e in kernels) / 1e3:.3f} ms, "
              f"grouped GEMMs {gemm / 1e3:.3f} ms")
        if args.paced:
            # Kernel spans of 12 steps issued back to back, then of 12 with the GPU idle 50 ms between
            # steps: if the back-to-back ones are longer, the card slows down under sustained load.
            for label, idle in (("back to back", 0.0), ("50 ms idle between", 50.0)):
                steps = trace_kernels(step, iters=12, idle_ms=idle, every=True)
                print(f"  kernel span per step, {label}: " + " ".join(f"{span_ms(k):.2f}" for k in steps))
                if not idle:  # the GPU idle between one step's last kernel and the next one's first
                    gaps = [(b[0]["ts"] - a[-1]["ts"] - a[-1]["dur"]) / 1e3 for a, b in zip(steps, steps[1:])]
                    print("  idle between steps, back to back: " + " ".join(f"{v:.2f}" for v in gaps))


if __name__ == "__main__":
    main()
