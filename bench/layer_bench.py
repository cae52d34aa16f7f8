#!/usr/bin/env python3
"""Layer benchmark: one Qwen3-MoE sparse block, moe_fuse timed side by side with its peers.

    python bench/layer_bench.py [--out DIR] [--shapes 30b,235b] [--tokens 4096,16384]
                                [--backward] [--quick] [--cpu-smoke] [--variants a,b]

Variants: hf_grouped_mm (eager reference), hf_inductor (the peer), moe_fuse, moe_fuse_triton (the
same backend with its all-Triton GEMMs: kernels.grouped_mm_path off), liger (if importable),
grouped_gemms_only (lower bound); on request hf_inductor_cudagraphs and moe_fuse_cudagraphs (the same
under mode="reduce-overhead"), moe_fuse_grouped_mm and moe_fuse_ragged (the row-ragged GEMMs through
torch._grouped_mm, or through kernels/ragged_gemm.py, at every size). Each is checked against eager on fresh random
inputs before it is timed; an exception becomes an error row. Columns: bench/README.md.
"""
import argparse, contextlib, copy, json, math, os, platform, signal, statistics, sys, time, traceback, types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo's moe_fuse wins, installed or not

from power import PowerSampler  # noqa: E402
from provenance import code_version  # noqa: E402  (bench/ is this script's directory)

import torch
import transformers
import triton
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

SHAPES = {  # name: (hidden H, moe_intermediate I, experts E, top-k)
    "30b": (2048, 768, 128, 8),     # Qwen3-30B-A3B
    "235b": (4096, 1536, 128, 8),   # Qwen3-235B-A22B
    "tiny": (64, 32, 8, 2),         # --cpu-smoke
}
VARIANTS = ["hf_grouped_mm", "hf_inductor", "moe_fuse", "moe_fuse_triton", "liger", "grouped_gemms_only"]
# On request only (--variants): the two compiled paths under mode="reduce-overhead" (CUDA graphs).
CUDAGRAPH_VARIANTS = ["hf_inductor_cudagraphs", "moe_fuse_cudagraphs"]
# On request only, A/B of kernels/ragged_gemm.py: moe_fuse with its row-ragged GEMMs through torch._grouped_mm
# at every size, or through ragged_gemm at every size (grouped_mm_path.RAGGED_MIN_ROWS = 0), or with the
# Gluon GEMMs (grouped_mm_path.GLUON), or with the Gluon GEMMs that carry SwiGLU / dSwiGLU (GLUON_SWIGLU,
# GLUON_DSWIGLU), or with SwiGLU fused and the other Gluon GEMMs where they suit (moe_fuse_gluon_fwd).
# moe_fuse_lean: the backend option moe_fuse.keep_rows=False (the sorted rows and the weighted activation not kept).
# moe_fuse_cutlass_wgrad: both weight gradients through CUTLASS (torch._grouped_mm) instead of kernels/gluon_wgrad.py
# (GLUON_WGRAD off).
AB_VARIANTS = ["moe_fuse_grouped_mm", "moe_fuse_ragged", "moe_fuse_gluon", "moe_fuse_gluon_fused", "moe_fuse_gluon_fwd",
               "moe_fuse_lean", "moe_fuse_cutlass_wgrad"]
LEAN_VARIANTS = ("moe_fuse_lean",)
AB_SWITCHES = {"moe_fuse_grouped_mm": (("RAGGED_TRITON", False),), "moe_fuse_ragged": (("RAGGED_MIN_ROWS", 0),),
               "moe_fuse_gluon": (("GLUON", True),),
               "moe_fuse_gluon_fused": (("GLUON_SWIGLU", True), ("GLUON_DSWIGLU", True)),
               "moe_fuse_gluon_fwd": (("GLUON", True), ("GLUON_SWIGLU", True)),
               "moe_fuse_cutlass_wgrad": (("GLUON_WGRAD", False),)}
PEER = "hf_inductor"
TOL = 2e-2


# ---------------------------------------------------------------- helpers
def sync(dev):
    torch.cuda.synchronize() if dev.type == "cuda" else None


def rel_err(out, ref, chunk=1 << 26):
    """||out - ref|| / ||ref|| in float64, in chunks (expert-weight grads are ~1e9 elements)."""
    o, r = out.detach().reshape(-1), ref.detach().reshape(-1)
    num = den = 0.0
    for i in range(0, o.numel(), chunk):
        a, b = o[i:i + chunk].double(), r[i:i + chunk].double()
        num += (a - b).square().sum().item()
        den += b.square().sum().item()
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)  # NaN stays NaN: "not err <= TOL" -> FAIL


def bench(fn, dev, quick, grad_to_none=None, row=None):
    """Median ms (and p20/p80). CUDA: triton do_bench (events, warm-up, L2 flush); with ``row``, also
    row["power"] = nvidia-smi's SM clock, power and power-cap share while it ran (bench/power.py)."""
    if dev.type == "cuda":
        with PowerSampler(skip_s=0.2) as smp:
            q = triton.testing.do_bench(fn, warmup=25 if quick else 100, rep=100 if quick else 500,
                                        grad_to_none=grad_to_none, quantiles=[0.2, 0.5, 0.8])
        if row is not None and smp.stats():
            row["power"] = smp.stats()
        return q[1], q[0], q[2]
    ts = []
    for i in range(2 + (5 if quick else 10)):
        for t in grad_to_none or []:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        if i >= 2:
            ts.append((time.perf_counter() - t0) * 1e3)
    qs = statistics.quantiles(ts, n=10)
    return statistics.median(ts), qs[1], qs[7]


def host_ms(fn, dev, grad_to_none=(), n=10):
    """Host ms per call of ``fn`` issued ``n`` times back to back, timed before the final synchronize: what the
    host takes to enqueue one step. When it is about the step's ms, the step is host-bound (it follows the
    machine's CPU, not the GPU). n stays small: a few hundred launches fit the device's queue, so the host never
    waits on the GPU inside the loop."""
    for _ in range(3):
        fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        for t in grad_to_none:
            t.grad = None
        fn()
    ms = (time.perf_counter() - t0) * 1e3 / n
    sync(dev)
    return ms


def time_fwd_bwd(step, dev, args, leaves, row):
    """A fwd+bwd row's figures: ms (p20, p80), on CUDA the host's time to issue the step, and the step's peak."""
    row["ms"], row["p20"], row["p80"] = bench(step, dev, args.quick, grad_to_none=leaves, row=row)
    if dev.type == "cuda":  # on the CPU enqueueing is the work itself
        row["host_ms"] = host_ms(step, dev, leaves)
    row["mem_mb"] = peak_mem_mb(step, dev, leaves)


def host_bound(row) -> bool:
    """Whether the host took at least 0.9x the step's ms to issue it: the reading then follows the CPU."""
    return bool(row.get("host_ms")) and row["host_ms"] >= 0.9 * row["ms"]


def peak_mem_mb(fn, dev, grad_to_none=()):
    """Peak device memory allocated during one call, over what was allocated before it."""
    if dev.type != "cuda":
        return None
    for t in grad_to_none:
        t.grad = None
    sync(dev)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    sync(dev)
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def matmul_peak(dev, dtype, quick):
    n = 8192 if dev.type == "cuda" else 512
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    ms = bench(lambda: torch.matmul(a, b), dev, quick)[0]
    return {"n": n, "ms": ms, "tflops": 2 * n**3 / (ms * 1e-3) / 1e12}


def ensure_moe_fuse_backend():
    """Make backend="moe_fuse" resolvable: entry point if installed, else register it here."""
    import torch._dynamo as dynamo
    if "moe_fuse" in dynamo.list_backends(exclude_tags=()):
        return "already resolvable (entry point or earlier registration)"
    import moe_fuse.backend as mb
    if "moe_fuse" not in dynamo.list_backends(exclude_tags=()):  # importing may have registered it
        dynamo.register_backend(compiler_fn=mb.moe_fuse_backend, name="moe_fuse")
    return f"registered from {mb.__file__}"


# ---------------------------------------------------------------- the block
def build_block(shape, dev, dtype):
    H, I, E, k = SHAPES[shape]
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                         num_experts_per_tok=k, norm_topk_prob=True, hidden_act="silu")
    cfg._experts_implementation = "grouped_mm"  # property (5.2x) or plain attribute (5.17)
    with torch.device(dev):
        block = Qwen3MoeSparseMoeBlock(cfg).to(dtype)
    impl = getattr(getattr(block.experts, "config", cfg), "_experts_implementation", None)
    if impl != "grouped_mm":
        raise RuntimeError(f"experts implementation is {impl!r}, not 'grouped_mm'")
    with torch.no_grad():  # transformers initialises the router to zeros: never time on zeros
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block


def liger_block(block):
    """Liger's instance patch (apply_liger_kernel_to_qwen3_moe binds LigerExperts.forward onto
    model.mlp.experts), applied to a shallow copy that shares the block's parameters."""
    from liger_kernel.transformers.swiglu import LigerExperts  # -> LigerFusedMoEFunction
    experts = copy.copy(block.experts)  # same _parameters dict: same Parameter objects
    experts.forward = types.MethodType(LigerExperts.forward, experts)
    lb = copy.copy(block)
    lb._modules = dict(block._modules, experts=experts)
    return lb


def make_variant(name, block, dev):
    """-> (callable x -> out, compiled?)"""
    if name.endswith("_cudagraphs"):  # mode="reduce-overhead": each step replays CUDA graphs
        backend = "moe_fuse" if name.startswith("moe_fuse") else "inductor"
        if backend == "moe_fuse":
            print(f"    moe_fuse backend: {ensure_moe_fuse_backend()}")
        compiled = torch.compile(block, backend=backend, mode="reduce-overhead", dynamic=False)

        def step(x):
            torch.compiler.cudagraph_mark_step_begin()  # each call is a new step: earlier outputs may be overwritten
            return compiled(x)

        return step, True
    if name.startswith("moe_fuse"):
        print(f"    moe_fuse backend: {ensure_moe_fuse_backend()}")
        options = {"moe_fuse.keep_rows": False} if name in LEAN_VARIANTS else None
        return torch.compile(block, backend="moe_fuse", dynamic=False, options=options), True
    if name == "hf_inductor":  # static shapes: one graph per case, no recompiles
        return torch.compile(block, backend="inductor", dynamic=False), True
    return {"hf_grouped_mm": lambda: block, "liger": lambda: liger_block(block)}[name](), False


# ---------------------------------------------------------------- grouped GEMMs alone
def gemms_setup(block, T, dev, dtype, grad):
    E, k = block.experts.num_experts, block.gate.top_k
    H, I = block.experts.hidden_dim, block.experts.intermediate_dim
    S = T * k
    counts = torch.full((E,), S // E, dtype=torch.int32)
    counts[: S % E] += 1
    offs = torch.cumsum(counts, 0, dtype=torch.int32).to(dev)
    w1 = block.experts.gate_up_proj.transpose(-2, -1)  # [E, H, 2I], the view transformers passes
    w2 = block.experts.down_proj.transpose(-2, -1)     # [E, I, H]
    xs = torch.randn(S, H, device=dev, dtype=dtype, requires_grad=grad)
    a = torch.randn(S, I, device=dev, dtype=dtype, requires_grad=grad)
    run = lambda: (torch._grouped_mm(xs, w1, offs=offs), torch._grouped_mm(a, w2, offs=offs))
    return run, xs, a, w1, w2, counts


def gemms_ref(xs, a, w1, w2, counts):  # per-expert torch.mm loop
    bounds = [0] + torch.cumsum(counts, 0).tolist()
    h = torch.cat([xs[s:e] @ w1[i] for i, (s, e) in enumerate(zip(bounds, bounds[1:]))])
    y = torch.cat([a[s:e] @ w2[i] for i, (s, e) in enumerate(zip(bounds, bounds[1:]))])
    return h, y


def run_gemms(block, T, dev, dtype, args, row_f, row_b):
    params = [block.experts.gate_up_proj, block.experts.down_proj]
    with torch.no_grad():  # check on fresh inputs against a per-expert loop
        run, xs, a, w1, w2, counts = gemms_setup(block, T, dev, dtype, False)
        out, ref = run(), gemms_ref(xs, a, w1, w2, counts)
        row_f["check_err"] = max(rel_err(o, r) for o, r in zip(out, ref))
        run, *_ = gemms_setup(block, T, dev, dtype, False)
        fwd = lambda: run()
        row_f["ms"], row_f["p20"], row_f["p80"] = bench(fwd, dev, args.quick, row=row_f)
        row_f["mem_mb"] = peak_mem_mb(fwd, dev)
    if row_b is None:
        return None
    run, xs, a, w1, w2, counts = gemms_setup(block, T, dev, dtype, True)
    outs = run()
    gs = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, [xs, a] + params, gs)
    want = torch.autograd.grad(gemms_ref(xs, a, w1, w2, counts), [xs, a] + params, gs)
    row_b["grad_err"] = max(rel_err(o, r) for o, r in zip(got, want))
    leaves = [xs, a] + params
    step = lambda: torch.autograd.backward(list(run()), gs)
    time_fwd_bwd(step, dev, args, leaves, row_b)
    for p in leaves:
        p.grad = None
    return step, leaves


# ---------------------------------------------------------------- one variant, one case
def run_block_variant(name, block, T, dev, dtype, args, row_f, row_b):
    H = block.experts.hidden_dim
    fn, compiled = make_variant(name, block, dev)
    rand = lambda: torch.randn(1, T, H, device=dev, dtype=dtype)

    # forward: check on fresh input (first call = compile), then time
    with torch.no_grad():
        x = rand()
        ref = block(x)
        t0 = time.perf_counter()
        out = fn(x)
        sync(dev)
        if compiled:
            row_f["compile_s"] = time.perf_counter() - t0
        row_f["check_err"] = rel_err(out, ref)
        del out, ref
        x = rand()
        fwd = lambda: fn(x)
        row_f["ms"], row_f["p20"], row_f["p80"] = bench(fwd, dev, args.quick, row=row_f)
        row_f["mem_mb"] = peak_mem_mb(fwd, dev)
    return run_block_backward(fn, compiled, block, rand, dev, args, row_b) if row_b is not None else None


def run_block_backward(fn, compiled, block, rand, dev, args, row_b):
    # forward+backward: loss = (out * g).sum(); gradients to x and every parameter
    params = list(block.parameters())
    x, g = rand().requires_grad_(True), rand()
    ref = block(x)
    want = torch.autograd.grad((ref * g).sum(), [x] + params)
    t0 = time.perf_counter()
    out = fn(x)  # training graph: compiled anew, so its output is checked too
    got = torch.autograd.grad((out * g).sum(), [x] + params)
    sync(dev)
    if compiled:
        row_b["compile_s"] = time.perf_counter() - t0
    row_b["check_err"] = rel_err(out, ref)
    errs = [rel_err(a, b) for a, b in zip(got, want)]
    row_b["grad_errs"] = dict(zip(["x"] + [n for n, _ in block.named_parameters()], errs))
    row_b["grad_err"] = max(errs)
    del got, want, out, ref
    x, g = rand().requires_grad_(True), rand()
    leaves = [x] + params

    def step():
        # Gradients start at None in every call (do_bench's warm-up calls do not reset them): under CUDA
        # graphs a gradient kept from the last call lives in a replayed graph's output buffer.
        for t in leaves:
            t.grad = None
        (fn(x) * g).sum().backward()

    time_fwd_bwd(step, dev, args, leaves, row_b)
    for p in leaves:
        p.grad = None
    return step, leaves


def try_explain(block, x):
    """Record what moe_fuse.explain says (which regions it rewrote), if it exists; never depend on it."""
    try:
        import moe_fuse
        return str(moe_fuse.explain(block, x))[:4000]
    except Exception as e:
        return f"(explain unavailable: {type(e).__name__}: {e})"[:300]


# ---------------------------------------------------------------- driver
def run_case(shape, T, dev, dtype, args, rows):
    H, I, E, k = SHAPES[shape]
    flops_f = 6 * T * k * H * I  # expert GEMMs only; the router's 2*T*H*E is not counted
    modes = [("fwd", flops_f)] + ([("fwd+bwd", 3 * flops_f)] if args.backward else [])
    print(f"\n=== {shape} (H={H} I={I} E={E} k={k})  T={T}  {dtype} on {dev}")
    block = build_block(shape, dev, dtype)
    steps = {}  # variant -> (its timed fwd+bwd step, the leaves whose grads it sets, its fwd+bwd row)
    for name in args.variants:
        by_mode = {m: dict(shape=shape, T=T, mode=m, variant=name, flops=f, status="ok") for m, f in modes}
        rf, rb = by_mode["fwd"], by_mode.get("fwd+bwd")
        case_rows = [r for r in (rf, rb) if r is not None]
        no_triton = dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
        if name in CUDAGRAPH_VARIANTS and dev.type != "cuda":
            print(f"  {name:20s} skipped: needs CUDA")
            rows += [dict(r, status="skipped", note="needs CUDA") for r in case_rows]
            continue
        if name == "liger" and (no_triton or not liger_version()):
            why = "needs CUDA or TRITON_INTERPRET=1" if no_triton else "liger_kernel (>= 0.8.0) not importable"
            print(f"  {name:20s} skipped: {why}")
            rows += [dict(r, status="skipped", note=why) for r in case_rows]
            continue
        torch._dynamo.reset()  # fresh Dynamo state: each compiled variant compiles cold
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        try:
            with switches(name):
                if name == "grouped_gemms_only":
                    timed = run_gemms(block, T, dev, dtype, args, rf, rb)
                else:
                    timed = run_block_variant(name, block, T, dev, dtype, args, rf, rb)
            if timed is not None:
                steps[name] = (*timed, rb)
        except Exception as e:
            tb = traceback.format_exc()
            print("    " + tb[-1500:].replace("\n", "\n    "))  # the end of it; all of it in the JSON
            msg = f"{type(e).__name__}: " + " ".join([l for l in str(e).splitlines() if l.strip()][:2])[:200]
            for r in case_rows:
                if r.get("ms") is None:
                    r.update(status="error", error=msg, traceback=tb[-8000:])
        for p in block.parameters():
            p.grad = None
        for r in case_rows:
            errs = [r.get("check_err"), r.get("grad_err")]
            if r["status"] == "ok" and any(e is not None and not e <= TOL for e in errs):
                r["status"] = "FAIL"
            print(f"  {name:20s} {r['mode']:8s} {fmt_row_short(r)}")
        rows += case_rows
    if args.rounds > 1 and steps:
        time_rounds(steps, dev, args)
    row_f = next((r for r in rows if (r["shape"], r["T"], r["mode"], r["variant"]) == (shape, T, "fwd", "moe_fuse")
                  and r["status"] == "ok"), None)
    if row_f is not None:  # last: explain() resets Dynamo
        with torch.no_grad():
            row_f["explain"] = try_explain(block, torch.randn(1, T, H, device=dev, dtype=dtype))
        print("    " + row_f["explain"].splitlines()[0][:150])
    del block, steps


@contextlib.contextmanager
def switches(name):
    """The module switches of an A/B variant (kernels.grouped_mm_path's, read at every call of the experts op),
    set while it runs and restored after."""
    from moe_fuse.kernels import grouped_mm_path

    pairs = AB_SWITCHES.get(name, ()) + ((("ENABLED", False),) if name == "moe_fuse_triton" else ())
    before = [(attr, getattr(grouped_mm_path, attr)) for attr, _ in pairs]
    for attr, value in pairs:
        setattr(grouped_mm_path, attr, value)
    try:
        yield
    finally:
        for attr, value in before:
            setattr(grouped_mm_path, attr, value)


def time_rounds(steps, dev, args):
    """--rounds N: the fwd+bwd steps timed N - 1 more times, the variants in turn, each round starting one variant
    later, so that none is always timed right after the same one (at its power limit the card's clock follows
    what ran before). Each row's ms becomes the median of its N readings, p20 / p80 their lowest and highest;
    rounds_ms keeps them all."""
    names = list(steps)
    for name in names:  # a variant compiled before a later one's Dynamo reset compiles again here, untimed
        step, leaves, row = steps[name]
        row["rounds_ms"] = [row["ms"]]
        row["rounds_host_ms"] = [row.get("host_ms")]
        with switches(name):
            step()
        for t in leaves:
            t.grad = None
    sync(dev)
    for r in range(1, args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            step, leaves, row = steps[name]
            with switches(name):
                row["rounds_ms"].append(bench(step, dev, args.quick, grad_to_none=leaves)[0])
                row["rounds_host_ms"].append(host_ms(step, dev, leaves) if dev.type == "cuda" else None)
            for t in leaves:
                t.grad = None
    for name in names:
        row = steps[name][2]
        ms = row["rounds_ms"]
        row["ms"], row["p20"], row["p80"] = statistics.median(ms), min(ms), max(ms)
        host = [h for h in row["rounds_host_ms"] if h is not None]
        if host:  # the host's figure for the median reading's rounds: their median too
            row["host_ms"] = statistics.median(host)
        print(f"  {name:20s} fwd+bwd  rounds {' '.join(f'{v:.3f}' for v in ms)} ms: median {row['ms']:.3f}"
              + (f"; host {' '.join(f'{v:.3f}' for v in host)} ms a step issued" if host else ""))


def liger_version():
    try:
        import importlib.metadata, liger_kernel.ops.fused_moe  # noqa: F401  (fused MoE: >= 0.8.0)
        return importlib.metadata.version("liger-kernel")
    except Exception:
        return None


def fmt_row_short(r):
    if r["status"] in ("error", "skipped"):
        return f"{r['status']}: {r.get('error') or r.get('note')}"
    e = lambda v: "-" if v is None else f"{v:.1e}"
    s = f"{r['status']:4s} {r['ms']:9.3f} ms  err {e(r.get('check_err'))}  grad err {e(r.get('grad_err'))}"
    s += f"  compile {r['compile_s']:.1f}s" if r.get("compile_s") else ""
    s += f"  host {r['host_ms']:.3f} ms a step{' (host-bound)' if host_bound(r) else ''}" if r.get("host_ms") else ""
    if r.get("power"):  # the card at its power limit runs slower clocks: read the figure with this
        p = r["power"]
        s += f"  [{p['sm_mhz']:.0f} MHz, {p['watts']:.0f} W, power cap {p['capped']:.0%}]"
    return s


def derive(rows, peak):
    peer = {(r["shape"], r["T"], r["mode"]): r for r in rows
            if r["variant"] == PEER and r.get("ms") and r["status"] != "error"}
    for r in rows:
        if r.get("ms"):
            r["tflops"] = r["flops"] / (r["ms"] * 1e-3) / 1e12
            r["pct_peak"] = 100 * r["tflops"] / peak["tflops"]
            p = peer.get((r["shape"], r["T"], r["mode"]))
            r["vs_inductor"] = p["ms"] / r["ms"] if p else None
            if p and len(p.get("rounds_ms", ())) == len(r.get("rounds_ms", ())) > 1:  # timed side by side
                r["vs_inductor_rounds"] = [a / b for a, b in zip(p["rounds_ms"], r["rounds_ms"])]


def print_table(rows, peak, meta):
    f = lambda v, spec: format("-", ">" + spec.split(".")[0]) if v is None else format(v, spec)
    hdr = (f"{'case':16s} {'mode':8s} {'variant':19s} {'status':7s} {'ms':>9s} {'TFLOP/s':>8s} "
           f"{'%peak':>6s} {'x_ind':>6s} {'mem MB':>8s} {'comp s':>7s} {'err':>8s} {'grad err':>8s}")
    print("\n" + "=" * len(hdr))
    print(f"layer_bench  {meta['device_name']}  torch {meta['torch']}  triton {meta['triton']}  "
          f"transformers {meta['transformers']}  moe_fuse@{meta['git']} (sources {meta['source_sha']})")
    print(f"matmul peak ({peak['n']}^3, {meta['dtype']}): {peak['tflops']:.1f} TFLOP/s;  "
          f"FLOPs = 6*T*k*H*I fwd, 3x fwd+bwd (router not counted);  x_ind = {PEER}_ms / ms")
    print(hdr)
    for r in rows:
        case = f"{r['shape']} T={r['T']}"
        if r["status"] in ("error", "skipped"):
            print(f"{case:16s} {r['mode']:8s} {r['variant']:19s} {r['status']:7s} "
                  f"{(r.get('error') or r.get('note') or '')[:90]}")
            continue
        print(f"{case:16s} {r['mode']:8s} {r['variant']:19s} {r['status']:7s} {f(r['ms'], '9.3f')} "
              f"{f(r.get('tflops'), '8.1f')} {f(r.get('pct_peak'), '6.1f')} {f(r.get('vs_inductor'), '6.2f')} "
              f"{f(r.get('mem_mb'), '8.0f')} {f(r.get('compile_s'), '7.1f')} {f(r.get('check_err'), '8.1e')} "
              f"{f(r.get('grad_err'), '8.1e')}")
    for r in rows:
        if r.get("vs_inductor_rounds") and r["variant"] != PEER:
            print(f"{r['shape']} T={r['T']} {r['mode']} {r['variant']}: x_ind by round "
                  + " ".join(f"{v:.3f}" for v in r["vs_inductor_rounds"]))
    for r in rows:
        if host_bound(r):
            print(f"{r['shape']} T={r['T']} {r['mode']} {r['variant']}: host-bound, {r['host_ms']:.3f} ms of host "
                  f"work a step issued back to back against {r['ms']:.3f} ms a step: this reading follows the CPU")


def plot(rows, peak, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"(no plot: {e})")
        return None
    modes = sorted({r["mode"] for r in rows}, key=["fwd", "fwd+bwd"].index)
    fig, axes = plt.subplots(1, len(modes), figsize=(7 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        cases = sorted({(r["shape"], r["T"]) for r in rows if r["mode"] == mode})
        names = [v for v in VARIANTS + CUDAGRAPH_VARIANTS + AB_VARIANTS if any(r["variant"] == v for r in rows)]
        w = 0.8 / max(1, len(names))
        for i, v in enumerate(names):
            rs = [next((r for r in rows if (r["shape"], r["T"], r["mode"], r["variant"]) == (s, T, mode, v)), {})
                  for s, T in cases]
            bars = ax.bar([j + i * w for j in range(len(cases))], [r.get("tflops") or 0 for r in rs], w, label=v)
            ax.bar_label(bars, [f"{r['ms']:.2f}ms" if r.get("ms") else r.get("status", "") for r in rs],
                         fontsize=6, rotation=90, padding=2)
        ax.axhline(peak["tflops"], ls="--", c="k", lw=0.8, label="matmul peak")
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(cases))], [f"{s}\nT={T}" for s, T in cases])
        ax.set_ylabel("TFLOP/s (6TkHI per fwd)")
        ax.set_title(mode)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "layer_bench.png"
    fig.savefig(path, dpi=120)
    return str(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    ap.add_argument("--shapes", default="30b,235b")
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--backward", action="store_true", help="also time forward+backward")
    ap.add_argument("--quick", action="store_true", help="one small case, short timing")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every variant's fwd+bwd this many times, in turn (median; default 1)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny fp32 config on the CPU (implies --backward)")
    args = ap.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    unknown = [v for v in args.variants if v not in VARIANTS + CUDAGRAPH_VARIANTS + AB_VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS + CUDAGRAPH_VARIANTS + AB_VARIANTS)}")
    if args.cpu_smoke:
        dev, dtype, args.backward, args.quick = torch.device("cpu"), torch.float32, True, True
        os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")  # its autotuner fails in the interpreter
        shapes, tokens = ["tiny"], [64]
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: use --cpu-smoke")
        dev, dtype = torch.device("cuda"), torch.bfloat16
        shapes = ["30b"] if args.quick else args.shapes.split(",")
        tokens = [2048] if args.quick else [int(t) for t in args.tokens.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    meta = dict(torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
                python=platform.python_version(), **code_version(), dtype=str(dtype).replace("torch.", ""),
                device_name=torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu",
                args=vars(args), started=time.strftime("%Y-%m-%d %H:%M:%S"), liger_kernel=liger_version())
    print(f"layer_bench: {meta}")
    peak = matmul_peak(dev, dtype, args.quick)
    print(f"matmul peak: {peak}")
    rows = []
    save = lambda: (out_dir / "layer_bench.json").write_text(
        json.dumps(dict(meta=meta, peak=peak, rows=rows), indent=1, default=str))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("SIGTERM: stopping, reporting what was measured"))
    try:
        for shape in shapes:
            for T in tokens:
                try:
                    run_case(shape, T, dev, dtype, args, rows)
                except Exception as e:  # e.g. out of memory building the block
                    traceback.print_exc()
                    rows.append(dict(shape=shape, T=T, mode="fwd", variant="(case)", status="error",
                                     error=f"{type(e).__name__}: {e}"[:200]))
                derive(rows, peak)
                save()  # a run cut short still leaves its numbers in --out
    finally:  # also on SIGTERM / Ctrl-C: the table is what the reader sees
        derive(rows, peak)
        try:
            meta["png"] = plot(rows, peak, out_dir)
        except Exception as e:
            meta["png"] = None
            print(f"(plot failed: {type(e).__name__}: {e})")
        save()
        print(f"\nwrote {out_dir / 'layer_bench.json'}" + (f" and {meta['png']}" if meta["png"] else ""))
        print_table(rows, peak, meta)


if __name__ == "__main__":
    main()
