#!/usr/bin/env python3
"""One MoE layer of several transformers families at their published shapes, forward + backward: HF eager, HF +
Inductor and moe_fuse side by side, same inputs, one process per call.

    PYTHONPATH=. python3 bench/families_layer_bench.py [--families mixtral,glm4_moe] [--tokens 8192] [--out DIR]
    .venv/bin/python bench/families_layer_bench.py --cpu-smoke        # no GPU: tiny fp32 blocks, checks the script

The Qwen3 benchmarks (layer_bench.py, train_step.py) measure one family in depth; this one asks the product
question across families: does ``backend="moe_fuse"`` rewrite each family's block on the GPU, is it right, and is it
never slower than Inductor on the same block? Each family's own sparse-MoE block (router, experts through
transformers' ``grouped_mm`` experts implementation, shared experts where the family has them) is built from its
config class with the sizes of the named checkpoint, random weights (never zeros: transformers initialises routers
to zeros).

--inference times the forward alone under torch.no_grad (moe_fuse's inference path, compiled for it).

Errors: relative norm against the same block in fp32 (the experts' eager loop, the bf16 block's weights) that routes
as the bf16 block does (its router is the bf16 one, outputs upcast; an fp32 router would flip near-tied choices where
a family computes its logits in bf16), for y and the gradients of x and every parameter. Exit status 1 when a
variant errs, moe_fuse rewrote nothing, or its worst error exceeds twice Inductor's + 1e-3.
"""
import argparse, contextlib, copy, importlib, json, os, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from layer_bench import bench, ensure_moe_fuse_backend, matmul_peak, peak_mem_mb, rel_err, sync  # noqa: E402
from provenance import code_version  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

# family: (checkpoint whose sizes these are, config class, block class, config fields, (H, I, E, k, I_shared))
FAMILIES = {
    "qwen3_moe": ("Qwen3-30B-A3B", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
                  dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                       norm_topk_prob=True)),
    "mixtral": ("Mixtral-8x7B", "MixtralConfig", "MixtralSparseMoeBlock",
                dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen1.5-MoE-A2.7B", "Qwen2MoeConfig", "Qwen2MoeSparseMoeBlock",
                  dict(hidden_size=2048, moe_intermediate_size=1408, num_experts=60, num_experts_per_tok=4,
                       shared_expert_intermediate_size=5632, norm_topk_prob=False)),
    "deepseek_v2": ("DeepSeek-V2-Lite", "DeepseekV2Config", "DeepseekV2Moe",
                    dict(hidden_size=2048, moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6,
                         n_shared_experts=2, topk_method="greedy", n_group=1, topk_group=1,
                         routed_scaling_factor=1.0, norm_topk_prob=False)),
    "glm4_moe": ("GLM-4.5-Air", "Glm4MoeConfig", "Glm4MoeMoE",
                 dict(hidden_size=4096, moe_intermediate_size=1408, n_routed_experts=128, num_experts_per_tok=8,
                      n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True)),
    "gpt_oss": ("gpt-oss-20b", "GptOssConfig", "GptOssMLP",
                dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4)),
    "olmoe": ("OLMoE-1B-7B", "OlmoeConfig", "OlmoeSparseMoeBlock",
              dict(hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
                   norm_topk_prob=False)),
}
SHARED_I = {"qwen2_moe": "shared_expert_intermediate_size", "deepseek_v2": 2, "glm4_moe": 1}  # field, or copies of I
TINY = dict(hidden_size=64, intermediate_size=32, moe_intermediate_size=32, shared_expert_intermediate_size=32)
VARIANTS = ["hf_eager", "hf_inductor", "moe_fuse"]
# moe_fuse_experts_only: the experts rewritten, the router left to Inductor (what the router op adds);
# moe_fuse_gmm_infer / moe_fuse_fused_infer (with --inference): the forward without h forced onto grouped_mm_path /
# the fused Triton GEMMs (moe_fuse picks by kernels.inference_on_grouped_mm)
AB_VARIANTS = ["moe_fuse_experts_only", "moe_fuse_gmm_infer", "moe_fuse_fused_infer"]
INFERENCE_PATH = {"moe_fuse_gmm_infer": True, "moe_fuse_fused_infer": False}
PEER = "hf_inductor"


def layer_flops(family, T):
    """Forward + backward FLOPs the layer needs: k routed experts and the shared experts (three H x I matrices
    each) and the router, 6 T H (3 (k I + I_shared) + E)."""
    fields = FAMILIES[family][3]
    H, k = fields["hidden_size"], fields["num_experts_per_tok"]
    I = fields.get("moe_intermediate_size", fields.get("intermediate_size"))
    E = next(fields[n] for n in ("num_experts", "num_local_experts", "n_routed_experts") if n in fields)
    shared = SHARED_I.get(family, 0)
    shared = fields[shared] if isinstance(shared, str) else shared * I
    return 6 * T * H * (3 * (k * I + shared) + E)


def build(family, dev, dtype, tiny=False):
    _, config_name, block_name, fields = FAMILIES[family]
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config_cls = getattr(transformers, config_name)
    if tiny:  # same family, small sizes; E and k kept small too
        fields = {k: TINY.get(k, v) for k, v in fields.items()}
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if key in fields:
                fields[key] = 8
        fields["num_experts_per_tok"] = min(fields["num_experts_per_tok"], 2)
    cfg = config_cls(**fields, hidden_act="silu") if family != "gpt_oss" else config_cls(**fields)
    cfg._experts_implementation = "grouped_mm"  # property (5.2x) or plain attribute (5.17)
    torch.manual_seed(0)
    block = getattr(mod, block_name)(cfg)
    with torch.no_grad():  # routers start as zeros, experts uninitialised: random weights of a trained scale
        for _, p in block.named_parameters():
            p.normal_(0, 0.02)
        for n, b in block.named_buffers():  # DeepSeek-V3-style selection biases: not all equal
            if b.is_floating_point():
                b.normal_(0, 0.01)
    return block.to(dev, dtype)


@contextlib.contextmanager
def experts_only():
    """moe_fuse with its router patterns switched off (while the block compiles)."""
    from moe_fuse import patterns
    saved = patterns.PATTERNS
    routers = {patterns.router_softmax.PATTERN, patterns.router_sigmoid.PATTERN, patterns.router_topk_softmax.PATTERN,
               patterns.router_unmatched.PATTERN}
    patterns.PATTERNS = tuple(p for p in saved if p not in routers)
    try:
        yield
    finally:
        patterns.PATTERNS = saved


def first(out):
    return out[0] if isinstance(out, tuple) else out


ROUTERS = ("gate", "router")  # the attribute holding each family's router module


class SameRouting(torch.nn.Module):
    """The bf16 block's router, its outputs upcast: the fp32 reference then picks the experts the bf16 block
    picks (an fp32 router flips near-tied choices of a router that computes in bf16: an error of the router's
    dtype, not of the experts)."""

    def __init__(self, router):
        super().__init__()
        self.inner = router

    def forward(self, h):
        dtype = next(self.inner.parameters()).dtype
        out = self.inner(h.to(dtype))
        return tuple(t.float() if t.is_floating_point() else t for t in out)


def reference(block, x, dy):
    """y and the gradients of x and every parameter of the block in fp32 (the experts on their eager loop) with the
    bf16 block's routing; the router weight's gradient comes through that router (bf16 below the upcast)."""
    ref = copy.deepcopy(block).float()
    for m in ref.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_experts_implementation"):
            cfg._experts_implementation = "eager"
    name = next(n for n in ROUTERS if isinstance(getattr(block, n, None), torch.nn.Module))
    setattr(ref, name, SameRouting(getattr(block, name)))
    xr = x.detach().float().requires_grad_(True)
    y = first(ref(xr.unsqueeze(0))).squeeze(0)
    y.backward(dy.float())
    grads = {n.replace(f"{name}.inner.", f"{name}."): p.grad for n, p in ref.named_parameters()}
    out = [y.detach(), xr.grad] + [grads[n].float() for n, _ in block.named_parameters()]
    for p in block.parameters():  # the router's, from the reference's backward
        p.grad = None
    return out


def run_family(family, T, dev, dtype, args, rows, peak):
    ckpt, _, _, fields = FAMILIES[family]
    block = build(family, dev, dtype, tiny=args.cpu_smoke)
    H = TINY["hidden_size"] if args.cpu_smoke else fields["hidden_size"]
    gen = torch.Generator(device="cpu").manual_seed(T)
    x = torch.randn(T, H, generator=gen).to(dev, dtype).requires_grad_(True)
    dy = torch.randn(T, H, generator=gen).to(dev, dtype)
    leaves = [x, *block.parameters()]
    names = ["y", "x"] + [n for n, _ in block.named_parameters()]
    ref = reference(block, x, dy)
    print(f"\n=== {family} ({ckpt}: H {H}) T={T}", flush=True)
    for name in args.variants:
        row = {"family": family, "checkpoint": ckpt, "variant": name, "T": T, "peak_tflops": peak["tflops"],
               "tiny": bool(args.cpu_smoke), "mode": "fwd" if args.inference else "fwd+bwd"}
        from moe_fuse import kernels
        kernels.INFERENCE_GROUPED_MM = INFERENCE_PATH.get(name)  # read at run time: set for the whole variant
        try:
            patterns = experts_only() if name == "moe_fuse_experts_only" else contextlib.nullcontext()
            if name.startswith("moe_fuse"):  # before the timed compile: explain resets Dynamo
                from moe_fuse import explain
                with patterns, torch.set_grad_enabled(not args.inference):
                    rep = explain(block, x.detach().unsqueeze(0))
                row["rewrites"] = [m["pattern"] for m in rep.matches]
                row["left_alone"] = [f"{r.get('pattern')}: {r.get('reason')}"[:200] for r in rep.rejected][:4]
            torch._dynamo.reset()
            fn = block if name == "hf_eager" else torch.compile(
                block, backend="inductor" if name == "hf_inductor" else "moe_fuse", dynamic=False)
            patterns = experts_only() if name == "moe_fuse_experts_only" else contextlib.nullcontext()

            def step():
                if args.inference:
                    with torch.no_grad():
                        return first(fn(x.unsqueeze(0))).squeeze(0)
                y = first(fn(x.unsqueeze(0))).squeeze(0)
                y.backward(dy)
                return y

            for t in leaves:
                t.grad = None
            t0 = time.perf_counter()
            with patterns:  # the compile happens here
                y = step()
            sync(dev)
            row["first_call_s"] = time.perf_counter() - t0
            got = [y.detach()] if args.inference else [y.detach(), x.grad] + [p.grad for p in block.parameters()]
            row["errors"] = {n: rel_err(g, r) for n, g, r in zip(names, got, ref)}
            row["worst_error"] = max(row["errors"].values())
            row["worst_at"] = max(row["errors"], key=row["errors"].get)
            row["peak_mb"] = peak_mem_mb(step, dev, leaves)
            ms, p20, p80 = bench(step, dev, args.quick, grad_to_none=leaves, row=row)
            row.update(ms=ms, p20=p20, p80=p80)
        except Exception as e:  # an error row, not a crash: the other variants and families still run
            row["error"] = f"{type(e).__name__}: {e}"
        finally:
            kernels.INFERENCE_GROUPED_MM = False
        rows.append(row)
        print(fmt(row), flush=True)
    torch._dynamo.reset()
    del block, ref


def fmt(r):
    if "error" in r:
        return f"  {r['variant']:<12} ERROR {r['error'][:400]}"
    rw = f" rewrites {r['rewrites']}" if "rewrites" in r else ""
    mem = f" peak {r['peak_mb']:.0f} MB" if r.get("peak_mb") is not None else ""
    return (f"  {r['variant']:<12} {r['ms']:9.3f} ms{mem} worst err {r['worst_error']:.2e} ({r['worst_at']})"
            f" first call {r['first_call_s']:.1f} s{rw}")


def verdicts(rows):
    """Per family: (ok, reason)."""
    out = {}
    for fam in dict.fromkeys(r["family"] for r in rows):
        case = {r["variant"]: r for r in rows if r["family"] == fam}
        bad = [f"{n}: {r['error'][:120]}" for n, r in case.items() if "error" in r]
        mf, ind = case.get("moe_fuse", {}), case.get(PEER, {})
        if not bad and not mf.get("rewrites"):
            bad.append("moe_fuse rewrote nothing")
        if not bad and not mf["worst_error"] <= 2 * ind["worst_error"] + 1e-3:
            bad.append(f"moe_fuse error {mf['worst_error']:.2e} > 2 x Inductor's {ind['worst_error']:.2e} + 1e-3")
        out[fam] = (not bad, "; ".join(bad))
    return out


def table(rows):
    lines = ["| family (sizes of) | T | HF eager | HF + Inductor | moe_fuse | x Inductor | x eager | % of matmul peak "
             "(Inductor / moe_fuse) | peak MB (Inductor / moe_fuse) | y err vs fp32 (Inductor / moe_fuse) | worst err "
             "(Inductor / moe_fuse) | moe_fuse rewrites |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ab = [v for v in AB_VARIANTS if any(r["variant"] == v for r in rows)]
    if ab:  # one more column per A/B variant: its ms
        lines = [lines[0] + "".join(f" {v} |" for v in ab), lines[1] + "---|" * len(ab)]
    for fam in dict.fromkeys(r["family"] for r in rows):
        for T in sorted({r["T"] for r in rows if r["family"] == fam}):
            c = {r["variant"]: r for r in rows if r["family"] == fam and r["T"] == T}
            ms = lambda n: f"{c[n]['ms']:.3f} ms" if "ms" in c.get(n, {}) else ("error" if n in c else "-")  # noqa: E731
            x = lambda n: f"{c[n]['ms'] / c['moe_fuse']['ms']:.2f}" if "ms" in c.get(n, {}) and "ms" in c.get(  # noqa: E731
                "moe_fuse", {}) else "-"
            mem = lambda n: f"{c[n]['peak_mb']:.0f}" if c.get(n, {}).get("peak_mb") is not None else "-"  # noqa: E731
            err = lambda n: f"{c[n]['worst_error']:.1e}" if "worst_error" in c.get(n, {}) else "-"  # noqa: E731
            yerr = lambda n: f"{c[n]['errors']['y']:.1e}" if "errors" in c.get(n, {}) else "-"  # noqa: E731
            any_row = next(iter(c.values()))
            flops = layer_flops(fam, T) / (3 if any_row.get("mode") == "fwd" else 1)
            pct = lambda n: (f"{100 * flops / (c[n]['ms'] * 1e-3) / 1e12 / c[n]['peak_tflops']:.0f}"  # noqa: E731
                             if "ms" in c.get(n, {}) and not c[n].get("tiny") else "-")
            rw = ", ".join(c.get("moe_fuse", {}).get("rewrites", [])) or "none"
            lines.append(f"| {fam} ({any_row['checkpoint']}) | {T} | {ms('hf_eager')} | {ms(PEER)} | "
                         f"{ms('moe_fuse')} | {x(PEER)} | {x('hf_eager')} | {pct(PEER)} / {pct('moe_fuse')} | {mem(PEER)} / "
                         f"{mem('moe_fuse')} | {yerr(PEER)} / {yerr('moe_fuse')} | {err(PEER)} / {err('moe_fuse')} | {rw} |"
                         + "".join(f" {ms(v)} |" for v in ab))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--tokens", default="8192")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"of {VARIANTS + AB_VARIANTS}; the table needs the first three")
    ap.add_argument("--inference", action="store_true",
                    help="the forward alone under torch.no_grad (the inference path), errors of y only")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny fp32 blocks of every family on the CPU")
    args = ap.parse_args()
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        sys.exit(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS + AB_VARIANTS]
    if bad:
        sys.exit(f"unknown variants {bad}; known: {', '.join(VARIANTS + AB_VARIANTS)}")
    ensure_moe_fuse_backend()
    if args.cpu_smoke:
        dev, dtype, tokens = torch.device("cpu"), torch.float32, [32]
        args.quick = True
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: use --cpu-smoke")
        dev, dtype = torch.device("cuda"), torch.bfloat16
        tokens = [int(t) for t in args.tokens.split(",")]
    peak = matmul_peak(dev, dtype, args.quick)
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(dev),
            "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None, "peak": peak,
            "code": code_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"{meta['gpu'] or 'cpu'}; torch {torch.__version__}, transformers {transformers.__version__}; "
          f"matmul peak {peak['tflops']:.1f} TFLOP/s", flush=True)
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for fam in families:
        for T in tokens:
            run_family(fam, T, dev, dtype, args, rows, peak)
            sync(dev)
        # after every family: a run cut short by a time limit keeps what it measured
        (out / "families_layer_bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1,
                                                                  default=str))
        (out / "families_layer_bench.md").write_text(table(rows) + "\n")
    print(table(rows))
    v = verdicts(rows)
    for fam, (ok, why) in v.items():
        print(f"{fam}: {'ok' if ok else 'FAIL: ' + why}")
    return 0 if all(ok for ok, _ in v.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
