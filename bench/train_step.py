#!/usr/bin/env python3
"""Training-step benchmark (issue #6): a whole Hugging Face Qwen3MoeForCausalLM with
Qwen3-30B-A3B layer shapes, eager vs backend="inductor" vs backend="moe_fuse".

    PYTHONPATH=. python3 bench/train_step.py [--layers 6] [--tokens 8192] [--seq 8192]
        [--backends eager,inductor,moe_fuse] [--ckpt off,on] [--steps 5] [--warmup 1]
        [--profile] [--out DIR] [--device auto] [--budget-s 480] [--tiny]

For every (ckpt, backend) variant: a fresh model from the same seed (identical weights), the
same input ids (labels = ids), torch.optim.AdamW. Measures the first step (compile), the
forward+backward median (CUDA events) and, separately, the AdamW step median; tokens/s, peak
memory, first-step loss (must agree across backends), ratios vs eager and vs inductor; with
--profile, one extra step under torch.profiler split into MoE / attention / dense GEMMs /
optimizer / rest (rules: bench/README.md). Writes train_step.md, train_step.json and
train_step.png (matplotlib permitting) to --out. --tiny is the CPU check.
"""
import argparse, collections, gc, json, os, platform, re, signal, statistics, sys, time, traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo's moe_fuse wins, installed or not

from provenance import code_version  # noqa: E402  (bench/ is this script's directory)

import torch
import torch._dynamo

# No GPU: Triton kernels run in Triton's interpreter; must be set before triton is imported.
if not torch.cuda.is_available() or re.search(r"--device[= ]cpu", " ".join(sys.argv)):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

try:
    import triton
    TRITON_VERSION = triton.__version__
except Exception:  # triton is optional for eager / CPU inductor
    TRITON_VERSION = None

# Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B), layer count and vocabulary as given.
FULL = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
            num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4,
            head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False)
CATEGORIES = ["moe", "attention", "dense_gemm", "optimizer", "rest"]
SEED = 0
INIT_STD = 0.02
LR = 1e-3  # large enough that bf16 weights move: losses over the steps show that gradients are sane


# ---------------------------------------------------------------- setup
def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def ensure_moe_fuse_backend():
    """Make backend="moe_fuse" resolvable: entry point if installed, else register it by hand."""
    import torch._dynamo as dynamo
    if "moe_fuse" in dynamo.list_backends(exclude_tags=()):
        return "already resolvable (entry point or earlier registration)"
    import moe_fuse.backend as mb
    if "moe_fuse" not in dynamo.list_backends(exclude_tags=()):  # importing may have registered it
        dynamo.register_backend(compiler_fn=mb.moe_fuse_backend, name="moe_fuse")
    return f"registered from {mb.__file__}"


def make_config(args):
    shape = dict(TINY if args.tiny else FULL)
    # 5.2x reads experts_implementation from the kwargs; 5.17 keeps it as a plain attribute.
    return Qwen3MoeConfig(num_hidden_layers=args.layers, use_cache=False, output_router_logits=False,
                          experts_implementation="grouped_mm", **shape)


def build_model(cfg, dev, dtype, ckpt):
    """Same seed -> same weights on the same device: every 2-D parameter (the router's too,
    which transformers starts at zero) from N(0, INIT_STD^2) drawn in parameter order."""
    torch.manual_seed(SEED)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters born in dtype; rotary inv_freq stays fp32
    try:
        with torch.device(dev):
            model = Qwen3MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    gen = torch.Generator(device=dev).manual_seed(SEED)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, INIT_STD, generator=gen)
    model.config.use_cache = False
    model.train()
    if ckpt:  # transformers 5.2x renamed it (the old name warns); 5.17 has only the old one
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    impl = getattr(model.config, "_experts_implementation", None)
    if impl != "grouped_mm":  # transformers' default for this model; insist on it
        try:
            model.set_experts_implementation("grouped_mm")
        except Exception:  # noqa: BLE001 - older 5.x: a plain attribute
            model.config._experts_implementation = "grouped_mm"
        impl = getattr(model.config, "_experts_implementation", None)
        if impl != "grouped_mm":
            print(f"    WARNING: experts implementation is {impl!r}, not 'grouped_mm'")
    return model


def make_optimizer(model, dev):
    if dev.type == "cuda":
        try:
            return torch.optim.AdamW(model.parameters(), lr=LR, fused=True), "fused"
        except Exception as e:  # noqa: BLE001 - fall back, say why
            print(f"    fused AdamW unavailable ({type(e).__name__}: {e}); foreach")
    return torch.optim.AdamW(model.parameters(), lr=LR, foreach=True), "foreach"


def compile_model(model, backend, args):
    if backend == "eager":
        return model
    if backend == "moe_fuse":
        print(f"    moe_fuse backend: {ensure_moe_fuse_backend()}")
        return torch.compile(model, backend="moe_fuse", dynamic=False,
                             options={"moe_fuse.inner": args.moe_fuse_inner})
    return torch.compile(model, backend=backend, dynamic=False)


def model_flops(cfg, tokens, seq):
    """Model FLOPs of one forward (matmuls only; causal attention counted half; recompute under
    checkpointing not counted). Training step = 3x."""
    H, I, E, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    nh, nkv, hd, V = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size
    per_tok_layer = (2 * (H * nh * hd + 2 * H * nkv * hd + nh * hd * H)  # q, k, v, o
                     + 2 * H * E + 2 * k * 3 * H * I                        # router, experts
                     + 2 * seq * nh * hd)                                   # QK^T + PV, causal half
    return tokens * (cfg.num_hidden_layers * per_tok_layer + 2 * H * V)


# ---------------------------------------------------------------- one step
def fwd_bwd(fn, ids):
    loss = fn(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach()


class Timer:
    """Elapsed ms between marks: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, dev):
        self.dev = dev
        self.marks = []

    def mark(self):
        if self.dev.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self):
        sync(self.dev)
        if self.dev.type == "cuda":
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def mem_peak_mib(dev):
    return torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else None


def mem_reset(dev):
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def mem_now_mib(dev):
    return torch.cuda.memory_allocated() / 2**20 if dev.type == "cuda" else None


# ---------------------------------------------------------------- profile split
def moe_kernel_names():
    """Our Triton kernels, read from moe_fuse/kernels (the lead adds kernels: no fixed list)."""
    names = {"_gate_up_kernel", "_down_kernel", "_dgrad_kernel", "_dx_kernel", "_wgrad_kernel",
             "_combine_kernel", "_dweights_kernel", "_softmax_topk_kernel"}
    for f in (ROOT / "moe_fuse" / "kernels").glob("*.py"):
        names.update(re.findall(r"^def (_\w*_kernel)\(", f.read_text(), flags=re.M))
    return names


MOE_KERNELS = moe_kernel_names()
ATTN_NAME = re.compile(r"flash|fmha|sdpa|cudnn|attention|attn", re.I)
ATTN_OP = re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|"
                     r"ScaledDotProduct|FlashAttention|EfficientAttention|CudnnAttention")
GEMM_NAME = re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|s16816|s1688|wgmma|splitk|"
                       r"^triton_tem_fused_(?:add)?mm|^triton_tem_fused_.*_mm_|aten::(?:add)?mm$|aten::bmm$|"
                       r"aten::linear$|aten::matmul$", re.I)
# a CPU op (or autograd node) on the launch chain that marks the kernel as part of the MoE block
MOE_OP = re.compile(r"moe_fuse::|grouped_mm|GroupedMm|aten::(?:arg)?sort\b|SortBackward|aten::histc|"
                    r"aten::topk|TopkBackward|aten::_?softmax\b|aten::_softmax_backward_data|SoftmaxBackward|"
                    r"aten::silu|SiluBackward|aten::index\b|IndexBackward|aten::index_put|IndexPutBackward|"
                    r"^moe_block$")
REST_OP = re.compile(r"embedding|Embedding|nll_loss|NllLoss|log_softmax|LogSoftmax|cross_entropy|rms_norm")
# Inductor's kernel names list the aten ops they fuse (descriptive_names="original_aten")
INDUCTOR_MOE = re.compile(r"silu|topk|sort|histc|grouped|index|(?<!log)_softmax")
INDUCTOR_REST = re.compile(r"embedding|log_softmax|nll_loss")


def classify(name, chain, moe_bwd=False):
    """One kernel -> category. chain: names of the CPU ops that launched it, innermost first.
    Rules in order (bench/README.md): our Triton kernels; attention by kernel name or SDPA op on
    the chain; the experts' grouped GEMMs (grouped_mm / moe_fuse::experts on the chain, or
    'group' in the name); other GEMMs = dense (incl. the router's T x H x E logits GEMM in every
    backend); the innermost chain op that names an MoE op (sort, histc, topk, softmax, silu,
    index, grouped_mm, moe_fuse::*) or a rest op (embedding, loss); eager: the backward of an op
    that ran inside a sparse MoE block (moe_bwd); Inductor kernel names; else rest."""
    m = re.match(r"(?:void\s+)?(_\w+?_kernel)(?![A-Za-z0-9])", name)  # Triton may add a suffix
    if (m and m.group(1) in MOE_KERNELS) or name.startswith(("_route", "_softmax_topk")):
        return "moe"
    if ATTN_NAME.search(name) or any(ATTN_OP.search(c) for c in chain):
        return "attention"
    if "group" in name.lower() or any(re.search(r"grouped_mm|GroupedMm|moe_fuse::experts", c) for c in chain):
        return "moe"
    if GEMM_NAME.search(name):
        return "dense_gemm"
    for c in chain:
        if REST_OP.search(c):
            return "rest"
        if MOE_OP.search(c):
            return "moe"
    if moe_bwd:
        return "moe"
    if name.startswith("triton_"):
        if INDUCTOR_REST.search(name):
            return "rest"
        if INDUCTOR_MOE.search(name):
            return "moe"
    return "rest"


def _chain(evt):
    out = []
    while evt is not None:
        out.append(evt)
        evt = evt.cpu_parent
    return out


def kernel_records(prof, dev):
    """[(kernel name, us, chain names, launched by the backward of an op inside an MoE block)]"""
    events = prof.events()
    # forward ops that ran inside a "moe_block" range (eager only: hooks) -> their autograd seq nrs
    moe_seq = set()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and e.sequence_nr >= 0:
            ch = _chain(e)
            if any(c.name == "moe_block" for c in ch) and not any(c.scope == 1 for c in ch):
                moe_seq.add((e.sequence_nr, e.thread))

    def bwd_of_moe(ch):
        for c in ch:
            if c.scope == 1:  # BACKWARD_FUNCTION
                return (c.sequence_nr, c.fwd_thread) in moe_seq
        return False

    recs = []
    if dev.type == "cuda":
        linked = collections.Counter()
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU and e.kernels:
                ch = _chain(e)
                names = [c.name for c in ch]
                mb = bwd_of_moe(ch)
                for k in e.kernels:
                    recs.append((k.name, k.duration, names, mb))
                    linked[k.name] += k.duration
        total = collections.Counter()
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CUDA:
                total[e.name] += e.time_range.end - e.time_range.start
        for n, us in total.items():  # kernels the profiler did not link to a CPU op: by name only
            if us - linked.get(n, 0) > 0.5:
                recs.append((n, us - linked.get(n, 0), [], False))
    else:  # CPU: the ops' self time stands in for kernels (checks the code path, not the numbers)
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0:
                ch = _chain(e)
                recs.append((e.name, e.self_cpu_time_total, [c.name for c in ch], bwd_of_moe(ch)))
    return recs


def summarize_profile(recs, opt_recs, top=10):
    split = dict.fromkeys(CATEGORIES, 0.0)
    by_name = {}
    attn_ops = collections.Counter()
    for name, us, chain, mb in recs:
        cat = classify(name, chain, mb)
        split[cat] += us / 1e3
        d = by_name.setdefault(name, dict(name=name[:300], ms=0.0, count=0, category=cat))
        d["ms"] += us / 1e3
        d["count"] += 1
        for c in chain:
            if ATTN_OP.search(c) and c.startswith("aten::"):
                attn_ops[c] += 1
                break
    opt_by_name = {}
    for name, us, _, _ in opt_recs:
        split["optimizer"] += us / 1e3
        d = opt_by_name.setdefault(name, dict(name=name[:300], ms=0.0, count=0, category="optimizer"))
        d["ms"] += us / 1e3
        d["count"] += 1
    total = sum(split.values())
    kernels = sorted(by_name.values(), key=lambda d: -d["ms"])
    return dict(
        split_ms=split, total_ms=total,
        split_pct={k: 100 * v / total if total else 0.0 for k, v in split.items()},
        fwdbwd_ms=total - split["optimizer"],
        attention_kernels=[dict(name=d["name"], ms=d["ms"], count=d["count"]) for d in kernels
                           if d["category"] == "attention"],
        sdpa_ops_kernels=dict(attn_ops),  # SDPA aten op -> kernels launched under it
        top10=kernels[:top],
        top10_optimizer=sorted(opt_by_name.values(), key=lambda d: -d["ms"])[:top],
        moe_kernels_seen=sorted({d["name"] for d in kernels if d["name"] in MOE_KERNELS}),
    )


class MoEBlockRanges:
    """Eager only: a profiler range "moe_block" around every sparse MoE block's forward, so the
    split can attribute the block's plain elementwise ops (and, via autograd sequence numbers,
    their backward). Never installed on a model that torch.compile traces."""

    def __init__(self, model):
        self.handles, self.stack = [], []
        for m in model.modules():
            if type(m).__name__.endswith("SparseMoeBlock"):
                self.handles.append(m.register_forward_pre_hook(self.enter))
                self.handles.append(m.register_forward_hook(self.exit))

    def enter(self, *_):
        rf = torch.autograd.profiler.record_function("moe_block")
        rf.__enter__()
        self.stack.append(rf)

    def exit(self, *_):
        self.stack.pop().__exit__(None, None, None)

    def remove(self):
        for h in self.handles:
            h.remove()


def profile_step(fn, model, opt, ids, dev, backend, args, tag):
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    ranges = MoEBlockRanges(model) if backend == "eager" else None
    try:
        opt.zero_grad(set_to_none=True)
        sync(dev)
        with profile(activities=acts) as prof:
            fwd_bwd(fn, ids)
            sync(dev)
        sync(dev)
        with profile(activities=acts) as prof_opt:
            opt.step()
            sync(dev)
    finally:
        if ranges:
            ranges.remove()
    if args.trace:
        prof.export_chrome_trace(str(Path(args.out) / f"trace_{tag}.json"))
    return summarize_profile(kernel_records(prof, dev), kernel_records(prof_opt, dev))


# ---------------------------------------------------------------- one variant
def run_variant(backend, ckpt, cfg, ids, dev, dtype, args, row):
    model = build_model(cfg, dev, dtype, ckpt)
    opt, row["optimizer"] = make_optimizer(model, dev)
    row["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    row["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    fn = compile_model(model, backend, args)
    ntok = ids.numel()
    reports = None
    if backend == "moe_fuse":
        try:
            from moe_fuse import debug as mf_debug
            reports = mf_debug.collect_reports()
        except Exception:  # noqa: BLE001 - the report is a bonus
            reports = None
    torch._dynamo.utils.counters.clear()

    # first step: compile (forward and backward graphs) + one run
    opt.zero_grad(set_to_none=True)
    sync(dev)
    t0 = time.perf_counter()
    if reports is not None:
        with reports as sink:
            loss = fwd_bwd(fn, ids)
            sync(dev)
        row["moe_fuse_report"] = [g.summary() for g in sink]
        pats = collections.Counter(m["pattern"] for g in sink for m in g.matches)
        row["moe_fuse_matches"] = dict(pats)
        row["moe_fuse_rejected"] = [r for g in sink for r in g.rejected][:20]
        print(f"    moe_fuse fused {dict(pats) or 'NOTHING'} in {len(sink)} graph(s), "
              f"{len(row['moe_fuse_rejected'])} region(s) left alone")
    else:
        loss = fwd_bwd(fn, ids)
        sync(dev)
    row["first_fwdbwd_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    opt.step()
    sync(dev)
    row["first_opt_s"] = time.perf_counter() - t0
    losses = [loss]
    c = torch._dynamo.utils.counters
    row["graphs"] = c["stats"].get("unique_graphs", 0) if backend != "eager" else None
    row["graph_breaks"] = sum(c["graph_break"].values()) if backend != "eager" else None
    if row["graph_breaks"]:
        row["graph_break_reasons"] = [str(k)[:200] for k in list(c["graph_break"])[:10]]
    print(f"    first step {row['first_fwdbwd_s']:.1f} s fwd+bwd (+{row['first_opt_s']:.2f} s AdamW), "
          f"loss {loss.item():.5f}, graphs {row['graphs']}, breaks {row['graph_breaks']}")

    for _ in range(args.warmup - 1):
        opt.zero_grad(set_to_none=True)
        losses.append(fwd_bwd(fn, ids))
        opt.step()
    sync(dev)

    # timed steps: [fwd+bwd | AdamW] per step, peaks per phase
    fb, op, peak_fb, peak_fb_over, peak_opt = [], [], [], [], []
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=True)
        sync(dev)
        base = mem_now_mib(dev)
        mem_reset(dev)
        tm = Timer(dev)
        tm.mark()
        losses.append(fwd_bwd(fn, ids))
        tm.mark()
        peak_fb.append(mem_peak_mib(dev))
        mem_reset(dev)
        opt.step()
        tm.mark()
        peak_opt.append(mem_peak_mib(dev))
        a, b = tm.intervals_ms()
        fb.append(a)
        op.append(b)
        if base is not None:
            peak_fb_over.append(peak_fb[-1] - base)
    med = statistics.median
    row.update(
        fwdbwd_ms=med(fb), fwdbwd_ms_all=fb, fwdbwd_ms_min=min(fb),
        opt_ms=med(op), opt_ms_all=op,
        step_ms=med([a + b for a, b in zip(fb, op)]),
        tokens=ntok,
    )
    row["tok_s_fwdbwd"] = ntok / (row["fwdbwd_ms"] * 1e-3)
    row["tok_s_step"] = ntok / (row["step_ms"] * 1e-3)
    row["tflops_fwdbwd"] = 3 * model_flops(cfg, ntok, ids.shape[1]) / (row["fwdbwd_ms"] * 1e-3) / 1e12
    if dev.type == "cuda":
        row["peak_fwdbwd_mib"] = max(peak_fb)
        row["peak_fwdbwd_over_base_mib"] = max(peak_fb_over)
        row["peak_opt_mib"] = max(peak_opt)
        row["reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    row["compile_s"] = row["first_fwdbwd_s"] - row["fwdbwd_ms"] * 1e-3 if backend != "eager" else None
    row["losses"] = [float(x) for x in torch.stack(losses).float().cpu()]
    row["first_loss"] = row["losses"][0]
    print(f"    fwd+bwd {row['fwdbwd_ms']:.2f} ms  AdamW {row['opt_ms']:.2f} ms  "
          f"{row['tok_s_fwdbwd']:.0f} tok/s fwd+bwd  peak {fmt_gib(row.get('peak_fwdbwd_mib'))} GiB  "
          f"losses {row['losses'][0]:.5f} -> {row['losses'][-1]:.5f}")

    if args.profile:
        try:
            row["profile"] = profile_step(fn, model, opt, ids, dev, backend, args, f"{backend}_ckpt{'on' if ckpt else 'off'}")
            p = row["profile"]
            print("    profile: " + "  ".join(f"{k} {p['split_ms'][k]:.2f} ms" for k in CATEGORIES)
                  + f"  (total {p['total_ms']:.2f} ms)")
            print(f"    attention kernels: {[d['name'][:100] for d in p['attention_kernels']] or '-'}; "
                  f"SDPA ops (kernels under each) {p['sdpa_ops_kernels'] or '-'}")
        except Exception as e:  # noqa: BLE001 - a failed profile does not fail the variant
            row["profile_error"] = f"{type(e).__name__}: {e}"[:500]
            print(f"    profile failed: {row['profile_error']}")
    del fn, model, opt, loss, losses


def free_memory(dev):
    gc.collect()
    torch._dynamo.reset()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ---------------------------------------------------------------- derive, table, plot
def fmt_gib(mib):
    return "-" if mib is None else f"{mib / 1024:.2f}"


def derive(rows, tol):
    ok = {(r["backend"], r["ckpt"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        for peer in ("eager", "inductor"):
            p = ok.get((peer, r["ckpt"]))
            r[f"x_{peer}"] = p["fwdbwd_ms"] / r["fwdbwd_ms"] if p else None
            r[f"x_{peer}_step"] = p["step_ms"] / r["step_ms"] if p else None
            if p and r.get("peak_fwdbwd_mib") and p.get("peak_fwdbwd_mib"):
                r[f"mem_vs_{peer}"] = r["peak_fwdbwd_mib"] / p["peak_fwdbwd_mib"]
        ref = ok.get(("eager", r["ckpt"])) or ok.get(("eager", "off"))
        if ref:
            r["loss_rel_diff_vs_eager"] = abs(r["first_loss"] - ref["first_loss"]) / abs(ref["first_loss"])
            r["loss_ok"] = r["loss_rel_diff_vs_eager"] <= tol


def markdown(rows, meta):
    f = lambda v, spec: "-" if v is None else format(v, spec)
    L = [f"# train_step: Qwen3MoeForCausalLM, {meta['config_name']} layers x{meta['layers']}, "
         f"{meta['tokens']} tokens/step (batch {meta['batch']} x seq {meta['seq']})", "",
         f"{meta['device_name']}; torch {meta['torch']}, triton {meta['triton']}, transformers "
         f"{meta['transformers']}; {meta['dtype']} params, AdamW ({meta['optimizer']}), {meta['steps']} timed "
         f"steps after {meta['warmup']} untimed; repo {meta['git']}, sources {meta['source_sha']}; {meta['params_total']:,} params", "",
         "fwd+bwd = forward (with the loss over the full vocabulary) + backward, median; AdamW timed separately. "
         "x_eager / x_ind = peer's fwd+bwd ms / this fwd+bwd ms (> 1 = faster), same ckpt. "
         "Peak = torch.cuda.max_memory_allocated during fwd+bwd (weights, grads and AdamW state included). "
         "compile = first fwd+bwd wall time minus the median.", "",
         "| ckpt | backend | status | fwd+bwd ms | AdamW ms | step ms | tok/s fwd+bwd | tok/s step | "
         "TFLOP/s | peak GiB | x_eager | x_ind | mem/ind | compile s | first loss | last loss |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            L.append(f"| {r['ckpt']} | {r['backend']} | {r['status']} | {(r.get('error') or '')[:160]} "
                     "|  |  |  |  |  |  |  |  |  |  |  |  |")
            continue
        loss_flag = "" if r.get("loss_ok", True) else " (!)"
        L.append(f"| {r['ckpt']} | {r['backend']} | ok | {r['fwdbwd_ms']:.2f} | {r['opt_ms']:.2f} | "
                 f"{r['step_ms']:.2f} | {r['tok_s_fwdbwd']:.0f} | {r['tok_s_step']:.0f} | "
                 f"{r['tflops_fwdbwd']:.3g} | {fmt_gib(r.get('peak_fwdbwd_mib'))} | {f(r.get('x_eager'), '.2f')} | "
                 f"{f(r.get('x_inductor'), '.2f')} | {f(r.get('mem_vs_inductor'), '.2f')} | "
                 f"{f(r.get('compile_s'), '.1f')} | {r['first_loss']:.5f}{loss_flag} | {r['losses'][-1]:.5f} |")
    prof = [r for r in rows if r.get("profile")]
    if prof:
        L += ["", "Profile of one extra step (GPU kernel time by category, ms; rules in bench/README.md):", "",
              "| ckpt | backend | MoE | attention | dense GEMMs | optimizer | rest | total | MoE kernels seen |",
              "|---|---|---|---|---|---|---|---|---|"]
        for r in prof:
            p = r["profile"]
            cell = lambda k: f"{p['split_ms'][k]:.2f} ({p['split_pct'][k]:.0f}%)"
            L.append(f"| {r['ckpt']} | {r['backend']} | " + " | ".join(cell(k) for k in CATEGORIES)
                     + f" | {p['total_ms']:.2f} | {', '.join(p['moe_kernels_seen']) or '-'} |")
        L += ["", "Attention kernels per variant:", ""]
        for r in prof:
            p = r["profile"]
            ks = "; ".join(f"`{d['name'][:110]}` {d['ms']:.2f} ms x{d['count']}" for d in p["attention_kernels"])
            L.append(f"- {r['backend']} ckpt {r['ckpt']}: SDPA ops (kernels under each) "
                     f"{p['sdpa_ops_kernels'] or '-'}; {ks or '-'}")
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        # The whole curve, not only its ends: at LR the later steps are sensitive to rounding, so one
        # backend's last loss can jump where the others' do not; the steps before show whether they agree.
        n = max(len(r["losses"]) for r in ok)
        L += ["", "Loss after each step (step 0 = the untimed first step, before any AdamW update):", "",
              "| ckpt | backend | " + " | ".join(str(i) for i in range(n)) + " |",
              "|---|---|" + "---|" * n]
        for r in ok:
            L.append(f"| {r['ckpt']} | {r['backend']} | " + " | ".join(f"{x:.4f}" for x in r["losses"]) + " |")
    mf = [r for r in rows if r.get("moe_fuse_matches") is not None]
    if mf:
        L += ["", "moe_fuse rewrites: " + "; ".join(f"ckpt {r['ckpt']}: {r['moe_fuse_matches'] or 'none'}" for r in mf)]
    return "\n".join(L) + "\n"


def plot(rows, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"(no PNG: matplotlib not importable: {e})")
        return None
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return None
    prof = [r for r in ok if r.get("profile")]
    has_mem = any(r.get("peak_fwdbwd_mib") for r in ok)
    n = 1 + has_mem + bool(prof)
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.8), squeeze=False)
    axes = list(axes[0])
    labels = [f"{r['backend']}\nckpt {r['ckpt']}" for r in ok]
    xs = range(len(ok))
    ax = axes[0]
    b1 = ax.bar(xs, [r["fwdbwd_ms"] for r in ok], label="fwd+bwd")
    ax.bar(xs, [r["opt_ms"] for r in ok], bottom=[r["fwdbwd_ms"] for r in ok], label="AdamW")
    ax.bar_label(b1, [f"{r['fwdbwd_ms']:.0f}" + (f"\nx_ind {r['x_inductor']:.2f}" if r.get("x_inductor") else "")
                      for r in ok], label_type="center", fontsize=7)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("ms per step")
    ax.set_title("training step (median)")
    ax.legend(fontsize=7)
    if has_mem:
        ax = axes[1]
        mem = [(r.get("peak_fwdbwd_mib") or 0) / 1024 for r in ok]
        bars = ax.bar(xs, mem, color="tab:gray")
        ax.bar_label(bars, [f"{m:.1f}" for m in mem], fontsize=7)
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("GiB")
        ax.set_title("peak memory, fwd+bwd")
    if prof:
        ax = axes[-1]
        bottom = [0.0] * len(prof)
        for k in CATEGORIES:
            v = [r["profile"]["split_ms"][k] for r in prof]
            ax.bar(range(len(prof)), v, bottom=bottom, label=k)
            bottom = [a + b for a, b in zip(bottom, v)]
        ax.set_xticks(range(len(prof)), [f"{r['backend']}\nckpt {r['ckpt']}" for r in prof], fontsize=7)
        ax.set_ylabel("GPU kernel ms, one profiled step (CPU: op self time)")
        ax.set_title("where the time goes")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "train_step.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


# ---------------------------------------------------------------- driver
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 6; --tiny: 2)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step = batch x seq (default 8192; --tiny: 64)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: --tokens, i.e. batch 1; --tiny: 32)")
    ap.add_argument("--backends", default="eager,inductor,moe_fuse")
    ap.add_argument("--ckpt", default="off,on", help="gradient checkpointing: off, on or off,on")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps, the first (compiling) one included")
    ap.add_argument("--profile", action="store_true", help="one extra step per variant under torch.profiler")
    ap.add_argument("--trace", action="store_true", help="with --profile: also write a chrome trace per variant")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    ap.add_argument("--device", default="auto", help="auto, cuda or cpu")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bf16 or fp32")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip the remaining variants when the next would end past this many seconds "
                         "(default 480; --tiny: no limit; 0: no limit)")
    ap.add_argument("--moe-fuse-inner", default="inductor", help='options={"moe_fuse.inner": ...}')
    ap.add_argument("--loss-tol", type=float, default=None,
                    help="relative first-loss tolerance vs eager (default 1e-4 fp32, 5e-3 bf16)")
    ap.add_argument("--tiny", action="store_true", help="tiny config (H 64, 8 experts, top-2, vocab 512), 64 tokens: the CPU check")
    args = ap.parse_args(argv)
    args.layers = args.layers or (2 if args.tiny else 6)
    args.tokens = args.tokens or (64 if args.tiny else 8192)
    args.seq = args.seq or (min(32, args.tokens) if args.tiny else args.tokens)
    if args.tokens % args.seq:
        ap.error(f"--tokens {args.tokens} is not a multiple of --seq {args.seq}")
    if args.budget_s is None:
        args.budget_s = 0.0 if args.tiny else 480.0
    args.warmup = max(1, args.warmup)
    args.steps = max(1, args.steps)
    args.backends = [b for b in args.backends.split(",") if b]
    args.ckpt = [c for c in args.ckpt.split(",") if c]
    if any(c not in ("off", "on") for c in args.ckpt):
        ap.error("--ckpt takes off, on or off,on")
    return args


def main(argv=None):
    args = parse_args(argv)
    dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if args.device == "auto" else args.device))
    if dev.type == "cpu" and not args.tiny:
        sys.exit("full-size model on the CPU: use --tiny (or run on a GPU)")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
        args.dtype, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if dev.type == "cpu" and args.tiny and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # tiny ops gain nothing from threads; on a busy machine they lose 100x
    tol = args.loss_tol or (1e-4 if dtype == torch.float32 else 5e-3)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    cfg = make_config(args)
    batch = args.tokens // args.seq
    ids = torch.randint(0, cfg.vocab_size, (batch, args.seq), generator=torch.Generator().manual_seed(SEED + 1)).to(dev)
    with torch.device("meta"):
        params_total = sum(p.numel() for p in Qwen3MoeForCausalLM(cfg).parameters())
    meta = dict(torch=torch.__version__, triton=TRITON_VERSION, transformers=transformers.__version__,
                python=platform.python_version(), **code_version(),
                device_name=torch.cuda.get_device_name() if dev.type == "cuda" else (platform.processor() or "cpu"),
                device=str(dev), cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version() if dev.type == "cuda" else None,
                dtype=str(dtype).replace("torch.", ""), config_name="tiny" if args.tiny else "Qwen3-30B-A3B",
                layers=args.layers, tokens=args.tokens, batch=batch, seq=args.seq, params_total=params_total,
                model_tflop_per_step=3 * model_flops(cfg, args.tokens, args.seq) / 1e12,
                steps=args.steps, warmup=args.warmup, lr=LR, init_std=INIT_STD, seed=SEED, loss_tol=tol,
                optimizer="fused" if dev.type == "cuda" else "foreach",
                triton_interpret=os.environ.get("TRITON_INTERPRET"), config=cfg.to_dict(), args=vars(args),
                started=time.strftime("%Y-%m-%d %H:%M:%S"))
    meta["config"] = {k: v for k, v in meta["config"].items() if isinstance(v, (int, float, str, bool, type(None)))}
    print(f"train_step: {meta['config_name']} x{args.layers} layers, {args.tokens} tokens (batch {batch} x seq "
          f"{args.seq}), {meta['dtype']} on {meta['device_name']}, {params_total / 1e9:.3f} B params; torch "
          f"{meta['torch']} triton {meta['triton']} transformers {meta['transformers']}")
    rows = []

    def save():
        derive(rows, tol)
        (out_dir / "train_step.json").write_text(json.dumps(dict(env=meta, variants=rows), indent=1, default=str))

    signal.signal(signal.SIGTERM, lambda *_: sys.exit("SIGTERM: stopping, reporting what was measured"))
    durations = {}
    try:
        for ckpt in args.ckpt:
            for backend in args.backends:
                row = dict(backend=backend, ckpt=ckpt, status="ok")
                elapsed = time.monotonic() - t_start
                est = durations.get(backend, max([0.0] + [v for k, v in durations.items()
                                                          if (k == "eager") == (backend == "eager")]))
                if args.budget_s and elapsed + est > args.budget_s:
                    row.update(status="skipped", error=f"budget: {elapsed:.0f} s used, next estimated "
                                                        f"{est:.0f} s, budget {args.budget_s:.0f} s")
                    print(f"\n=== {backend} ckpt {ckpt}: skipped ({row['error']})")
                    rows.append(row)
                    continue
                print(f"\n=== {backend} ckpt {ckpt}  ({elapsed:.0f} s elapsed)")
                t0 = time.monotonic()
                try:
                    run_variant(backend, ckpt == "on", cfg, ids, dev, dtype, args, row)
                except Exception as e:  # OOM, compile error, ...: record it, carry on
                    tb = traceback.format_exc()
                    print("    " + tb[-2000:].replace("\n", "\n    "))
                    row.update(status="failed", error=f"{type(e).__name__}: " + " ".join(
                        l for l in str(e).splitlines() if l.strip())[:300], traceback=tb[-8000:])
                    for k in ("fwdbwd_ms", "opt_ms", "step_ms"):
                        row.pop(k, None)
                    del e
                free_memory(dev)
                durations[backend] = max(durations.get(backend, 0.0), time.monotonic() - t0)
                row["wall_s"] = time.monotonic() - t0
                rows.append(row)
                save()
    finally:  # also on SIGTERM / Ctrl-C
        save()
        first = [(r["backend"], r["ckpt"], r["first_loss"], r.get("loss_rel_diff_vs_eager")) for r in rows
                 if r["status"] == "ok"]
        print("\nfirst-step losses: " + "; ".join(
            f"{b}/{c} {l:.6f}" + ("" if d is None else f" (rel diff vs eager {d:.1e})") for b, c, l, d in first))
        bad = [r for r in rows if r.get("loss_ok") is False]
        if bad:
            print(f"WARNING: first-step loss differs from eager by more than {tol:g} (relative): "
                  + ", ".join(f"{r['backend']}/{r['ckpt']}" for r in bad))
        try:
            meta["png"] = plot(rows, out_dir)
        except Exception as e:  # noqa: BLE001
            meta["png"] = None
            print(f"(plot failed: {type(e).__name__}: {e})")
        meta["total_s"] = time.monotonic() - t_start
        save()
        md = markdown(rows, meta)
        (out_dir / "train_step.md").write_text(md)
        print("\n" + md)
        print(f"wrote {out_dir / 'train_step.json'}, {out_dir / 'train_step.md'}"
              + (f", {meta['png']}" if meta.get("png") else "") + f"  ({meta['total_s']:.0f} s)")
    return rows


if __name__ == "__main__":
    main()
