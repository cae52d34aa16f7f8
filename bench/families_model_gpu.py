#!/usr/bin/env python3
"""Whole causal-LM models of other families (Mixtral, GLM-4.5-Air, DeepSeek-V2-Lite, OLMoE, Qwen1.5-MoE, Llama 4
Scout's text model), a few layers at the published layer shapes, one training step's forward + backward under eager, backend="inductor" and
backend="moe_fuse" (and moe_fuse without its attention-mask rewrite, to tell that gain from the MoE layers').

    PYTHONPATH=. python3 bench/families_model_gpu.py [--families mixtral,glm4_moe] [--layers 2] [--seq 4096]
    .venv/bin/python bench/families_model_gpu.py --cpu-smoke --families olmoe      # no GPU: tiny models

train_step.py measures Qwen3 in depth (optimizer, checkpointing, profile split); this asks whether the whole-model
gain carries over to the other families: every MoE layer rewritten, the loss as eager's, the step faster. The MoE
sizes are families_layer_bench.FAMILIES' (Llama 4's: ``OWN_SIZES``); attention as in each checkpoint's config; a smaller vocabulary (32000)
and no dense layers before the first MoE layer. Gradients against eager are reported as relative norms for both
compiled backends (bf16 on all sides: routing of near-tied tokens differs between any two of them).
"""
import argparse, contextlib, importlib, json, os, pickle, shutil, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from families_layer_bench import FAMILIES as LAYER_FAMILIES  # noqa: E402
from layer_bench import bench, ensure_moe_fuse_backend, peak_mem_mb, rel_err  # noqa: E402
import memory_peak  # noqa: E402
from provenance import code_version  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

# family: (model class, attention and model fields of the checkpoint FAMILIES names)
MODELS = {
    "mixtral": ("MixtralForCausalLM", dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                           sliding_window=None)),
    "glm4_moe": ("Glm4MoeForCausalLM", dict(num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                                            partial_rotary_factor=0.5, first_k_dense_replace=0, use_qk_norm=False,
                                            intermediate_size=10944)),
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
                                                  kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                                  v_head_dim=128, first_k_dense_replace=0, intermediate_size=10944)),
    "olmoe": ("OlmoeForCausalLM", dict(num_attention_heads=16, num_key_value_heads=16)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(num_attention_heads=16, num_key_value_heads=16, decoder_sparse_step=1,
                                              mlp_only_layers=[], intermediate_size=5632)),
    "llama4": ("Llama4ForCausalLM", dict(num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                                         interleave_moe_layer_step=1)),
}
# Families whose MoE block families_layer_bench does not time (its own module: the dense_experts pattern), in its
# FAMILIES' form: (checkpoint, config class, block class, MoE fields).
OWN_SIZES = {
    "llama4": ("Llama 4 Scout", "Llama4TextConfig", "Llama4TextMoe",
               dict(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_local_experts=16,
                    num_experts_per_tok=1)),
}
FAMILIES = {**LAYER_FAMILIES, **OWN_SIZES}
EXPERTS_PATTERNS = {"grouped_mm_experts", "dense_experts"}
TINY = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=64, intermediate_size_mlp=64,
            shared_expert_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=8)
VOCAB = 32000
# moe_fuse_no_mask: the attention-mask rewrite off; moe_fuse_lean: moe_fuse.keep_rows=False (less kept per layer);
# moe_fuse_repeat_kv: the mask rewritten but transformers' repeated key / value heads kept (config.causal_sdpa_grouped_heads)
BACKENDS = ["eager", "inductor", "moe_fuse", "moe_fuse_no_mask", "moe_fuse_lean", "moe_fuse_repeat_kv"]
OPTIONS = {"moe_fuse_no_mask": {"moe_fuse.causal_sdpa": False}, "moe_fuse_lean": {"moe_fuse.keep_rows": False}}
SWITCHES = {"moe_fuse_repeat_kv": ("moe_fuse.config", "causal_sdpa_grouped_heads", False)}  # set while it runs


def build(family, layers, dev, dtype, tiny=False):
    model_name, attn = MODELS[family]
    _, config_name, _, moe = FAMILIES[family]
    fields = {**moe, **attn}
    if tiny:
        mha = fields["num_key_value_heads"] == fields["num_attention_heads"]
        fields = {k: TINY.get(k, v) for k, v in fields.items()}
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if key in fields:
                fields[key] = 8
        fields["num_experts_per_tok"] = min(fields["num_experts_per_tok"], 2)
        if mha:  # multi-head attention stays so (multi-head latent attention needs it)
            fields["num_key_value_heads"] = fields["num_attention_heads"]
    config = getattr(transformers, config_name)(**fields, num_hidden_layers=layers, vocab_size=256 if tiny else VOCAB,
                                                use_cache=False, attn_implementation="sdpa", hidden_act="silu")
    if family not in OWN_SIZES:  # a family with its own MoE module has no experts implementation to pick
        config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():  # routers start as zeros, experts uninitialised: random weights of a trained scale
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
        for name, b in model.named_buffers():  # DeepSeek-V3-style selection biases: not all equal
            if b.is_floating_point() and "bias" in name:
                b.normal_(0, 0.01)
    return model.to(dev, dtype).train()


def step(model, ids):
    def run():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss
    return run


def run_family(family, args, dev, dtype, rows):
    model = build(family, args.layers, dev, dtype, tiny=args.cpu_smoke)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=gen).to(dev)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    print(f"\n=== {family} ({FAMILIES[family][0]} layers x{args.layers}, {args.batch} x {args.seq} tokens)", flush=True)
    want = None
    for backend in args.backends:
        row = {"family": family, "backend": backend, "layers": args.layers, "tokens": args.batch * args.seq}
        with switched(backend):
            run_backend(backend, model, ids, params, names, family, args, dev, row, want)
        if want is None and "loss" in row:
            want = (row["loss"], row.pop("_grads"))
        row.pop("_grads", None)
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
    torch._dynamo.reset()


@contextlib.contextmanager
def switched(backend):
    if backend not in SWITCHES:
        yield
        return
    module, attr, value = SWITCHES[backend]
    module = importlib.import_module(module)
    before = getattr(module, attr)
    setattr(module, attr, value)
    try:
        yield
    finally:
        setattr(module, attr, before)


def run_backend(backend, model, ids, params, names, family, args, dev, row, want):
    """One backend's step on ``row``: loss and gradients against ``want`` (the first backend's), peak, time."""
    try:
        torch._dynamo.reset()
        debug = Path(args.out) / "moe_fuse_debug" / f"{family}_{backend}"
        shutil.rmtree(debug, ignore_errors=True)  # the rewrites counted are this run's
        opts = None
        if backend.startswith("moe_fuse"):
            opts = {"moe_fuse.debug_dir": str(debug), **OPTIONS.get(backend, {})}
        fn = model if backend == "eager" else torch.compile(
            model, backend="inductor" if backend == "inductor" else "moe_fuse", options=opts)
        run = step(fn, ids)
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        loss = run().detach().float().item()
        row["first_step_s"] = time.perf_counter() - t0
        grads = [p.grad for p in params]
        row["loss"] = loss
        if want is None:
            row["_grads"] = [g.detach().clone() for g in grads]
        else:
            errs = {n: rel_err(g, w) for n, g, w in zip(names, grads, want[1])}
            row["loss_rel_err"] = abs(loss - want[0]) / abs(want[0])
            row["worst_grad"] = max(errs.items(), key=lambda kv: kv[1])
        if backend.startswith("moe_fuse"):
            reports = [json.loads(p.read_text()) for p in sorted(debug.glob("*/report.json"))]
            row["rewrites"] = sorted(m["pattern"] for r in reports for m in r["matches"])
            row["rejected"] = [(r_["pattern"], r_["reason"][:160]) for r in reports for r_ in r["rejected"]]
        del grads
        row["peak_mb"] = peak_mem_mb(run, dev, params)
        if args.memory_snapshot and dev.type == "cuda":  # what holds the memory at the peak, by allocation site
            snap = Path(args.out) / f"snapshot_{family}_{backend}.pickle"
            for p in params:
                p.grad = None
            memory_peak.record(run, snap)
            with open(snap, "rb") as f:
                trace = pickle.load(f)["device_traces"][0]
            row["peak_sites"] = memory_peak.summary(trace, top=15)
            row["peak_blocks"] = memory_peak.detail(trace, top=25)  # the generated code is on disk here only
            print("\n".join(row["peak_sites"] + row["peak_blocks"]), flush=True)
        row["ms"] = bench(run, dev, quick=args.cpu_smoke, grad_to_none=params)[0]
    except Exception as e:  # an error row: the other backends and families still run
        row["error"] = f"{type(e).__name__}: {e}"[:600]


def table(rows):
    lines = ["| family (layer sizes of) | layers x tokens | eager | Inductor | moe_fuse | x Inductor | x eager | moe_fuse "
             "without the mask rewrite | peak MB (Inductor / moe_fuse) | moe_fuse lean (keep_rows off): ms, peak MB | "
             "loss rel. err vs eager (Inductor / moe_fuse) | moe_fuse rewrites |", "|---" * 12 + "|"]
    for fam in dict.fromkeys(r["family"] for r in rows):
        c = {r["backend"]: r for r in rows if r["family"] == fam}
        ms = lambda b: f"{c[b]['ms']:.2f} ms" if "ms" in c.get(b, {}) else ("error" if b in c else "-")  # noqa: E731
        x = lambda b: f"{c[b]['ms'] / c['moe_fuse']['ms']:.2f}" if "ms" in c.get(b, {}) and "ms" in c.get(  # noqa: E731
            "moe_fuse", {}) else "-"
        mem = lambda b: f"{c[b]['peak_mb']:.0f}" if c.get(b, {}).get("peak_mb") is not None else "-"  # noqa: E731
        lre = lambda b: f"{c[b]['loss_rel_err']:.1e}" if "loss_rel_err" in c.get(b, {}) else "-"  # noqa: E731
        rw = c.get("moe_fuse", {}).get("rewrites", [])
        rws = ", ".join(f"{p} x{rw.count(p)}" for p in dict.fromkeys(rw)) or "none"
        any_row = next(iter(c.values()))
        lines.append(f"| {fam} ({FAMILIES[fam][0]}) | {any_row['layers']} x {any_row['tokens']} | {ms('eager')} | "
                     f"{ms('inductor')} | {ms('moe_fuse')} | {x('inductor')} | {x('eager')} | {ms('moe_fuse_no_mask')} | "
                     f"{mem('inductor')} / {mem('moe_fuse')} | {ms('moe_fuse_lean')}, {mem('moe_fuse_lean')} | "
                     f"{lre('inductor')} / {lre('moe_fuse')} | {rws} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(MODELS))
    ap.add_argument("--backends", default=",".join(BACKENDS[:4]), help=f"any of {', '.join(BACKENDS)}")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--memory-snapshot", action="store_true",
                    help="one more step per backend under the allocator's trace: the blocks live at its peak, by site")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    args = ap.parse_args()
    families = [f for f in args.families.split(",") if f]
    args.backends = [b for b in args.backends.split(",") if b]
    bad = [f for f in families if f not in MODELS] + [b for b in args.backends if b not in BACKENDS]
    if bad:
        sys.exit(f"unknown families or backends {bad}; families: {', '.join(MODELS)}; backends: {', '.join(BACKENDS)}")
    if args.backends[0] != "eager":
        sys.exit("the first backend must be eager: the others are compared with it")
    ensure_moe_fuse_backend()
    if args.cpu_smoke:
        dev, dtype, args.seq, args.batch = torch.device("cpu"), torch.float32, 32, 2
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: use --cpu-smoke")
        dev, dtype = torch.device("cuda"), torch.bfloat16
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "layers": args.layers,
            "batch": args.batch, "seq": args.seq, "vocab": VOCAB, "code": code_version(),
            "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for fam in families:
        run_family(fam, args, dev, dtype, rows)
        (out / "families_model.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
        (out / "families_model.md").write_text(table(rows) + "\n")
    print(table(rows))
    failed = [r for r in rows if "error" in r or (r["backend"] == "moe_fuse" and not EXPERTS_PATTERNS & set(
        r.get("rewrites", [])))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
