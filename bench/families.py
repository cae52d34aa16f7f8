#!/usr/bin/env python3
"""One MoE layer of each transformers family at a published checkpoint's sizes: eager, Inductor and moe_fuse on
the same inputs, forward + backward (or the forward alone with --inference).

    python bench/families.py [--families mixtral,gpt_oss,llama4] [--tokens 8192] [--inference] [--out DIR]
    python bench/families.py --cpu-smoke --families glm4_moe,llama4   # tiny blocks on the CPU, aot_eager for Inductor

Each family's own sparse-MoE block (router, experts through transformers' grouped_mm experts implementation,
shared experts where the family has them), random weights. Errors: relative to the same block in fp32 (experts on
their eager loop) that routes as the bf16 block does, for y and the gradients of x and every parameter. % of peak:
the FLOPs the layer needs, 6 T H (3 (k I + I_shared) + E) forward + backward (a third of it forward), over the
matmul peak measured in the same run. Exit status 1 when a variant errs, moe_fuse rewrote nothing, or its worst
error exceeds twice Inductor's + 1e-3. ``moe_fuse:name=value`` runs moe_fuse under those moe_fuse.config settings.
Writes families_<gpu>.{md,json,png}.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the checkout on sys.path)

import torch  # noqa: E402
from moe_fuse import config  # noqa: E402

# family: (checkpoint whose sizes these are, config class, block class, config fields)
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
    # every token through all 16 experts (scores 0 off the top-1); moe_fuse runs the chosen expert only
    "llama4": ("Llama-4-Scout", "Llama4TextConfig", "Llama4TextMoe",
               dict(hidden_size=5120, intermediate_size=8192, num_local_experts=16, num_experts_per_tok=1)),
}
SHARED_I = {"qwen2_moe": "shared_expert_intermediate_size", "deepseek_v2": 2, "glm4_moe": 1, "llama4": 1}  # field, or copies of I
TINY = dict(hidden_size=64, intermediate_size=32, moe_intermediate_size=32, shared_expert_intermediate_size=32)
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
BASES = ["eager", "inductor", "moe_fuse"]
PEER = "inductor"


def fields_of(family, tiny):
    fields = dict(FAMILIES[family][3])
    if tiny:
        fields = {k: TINY.get(k, v) for k, v in fields.items()}
        fields.update({k: 8 for k in EXPERT_FIELDS if k in fields})
        fields["num_experts_per_tok"] = min(fields["num_experts_per_tok"], 2)
    return fields


def layer_flops(family, T, tiny=False):
    """Forward + backward FLOPs of the k routed experts, the shared ones and the router: 6 T H (3 (k I + I_shared) + E)."""
    fields = fields_of(family, tiny)
    H, k = fields["hidden_size"], fields["num_experts_per_tok"]
    I = fields.get("moe_intermediate_size", fields.get("intermediate_size"))
    E = next(fields[n] for n in EXPERT_FIELDS if n in fields)
    shared = SHARED_I.get(family, 0)
    shared = fields[shared] if isinstance(shared, str) else shared * I
    return 6 * T * H * (3 * (k * I + shared) + E)


def build(family, dev, dtype, tiny=False):
    import transformers

    _, config_name, block_name, _ = FAMILIES[family]
    fields = fields_of(family, tiny)
    config_cls = getattr(transformers, config_name)
    cfg = config_cls(**fields) if family == "gpt_oss" else config_cls(**fields, hidden_act="silu")
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    block = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), block_name)(cfg)
    with torch.no_grad():  # routers start at zeros, experts uninitialised: random weights of a trained scale
        for p in block.parameters():
            p.normal_(0, 0.02)
        for b in block.buffers():  # selection biases: not all equal
            if b.is_floating_point():
                b.normal_(0, 0.01)
    return block.to(dev, dtype)


def first(out):
    return out[0] if isinstance(out, tuple) else out


class SameRouting(torch.nn.Module):
    """The bf16 block's router, its outputs upcast: the fp32 reference then picks the experts the bf16 block picks
    (an fp32 router would flip near-tied choices: an error of the router's dtype, not of the experts)."""

    def __init__(self, router):
        super().__init__()
        self.inner = router

    def forward(self, h):
        out = self.inner(h.to(next(self.inner.parameters()).dtype))
        return tuple(t.float() if t.is_floating_point() else t for t in out)


def reference(block, x, dy):
    """y, then the gradients of x and every parameter, of the block in fp32 (experts on their eager loop) routed by
    the bf16 block's router."""
    ref = copy.deepcopy(block).float()
    for m in ref.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_experts_implementation"):
            cfg._experts_implementation = "eager"
    name = next(n for n in ("gate", "router") if isinstance(getattr(block, n, None), torch.nn.Module))
    setattr(ref, name, SameRouting(getattr(block, name)))
    xr = x.detach().float().requires_grad_(True)
    y = first(ref(xr.unsqueeze(0))).reshape(xr.shape)
    y.backward(dy.float())
    grads = {n.replace(f"{name}.inner.", f"{name}."): p.grad for n, p in ref.named_parameters()}
    out = [y.detach(), xr.grad] + [grads[n].float() for n, _ in block.named_parameters()]
    for p in block.parameters():  # the router's, from the reference's backward
        p.grad = None
    return out


def run_family(family, T, dev, dtype, args, peak, rows):
    from moe_fuse.debug import collect_reports

    checkpoint = FAMILIES[family][0]
    block = build(family, dev, dtype, tiny=args.cpu_smoke)
    H = fields_of(family, args.cpu_smoke)["hidden_size"]
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=gen).to(dev, dtype).requires_grad_(True)
    dy = torch.randn(T, H, generator=gen).to(dev, dtype)
    leaves = [x, *block.parameters()]
    names = ["y", "x"] + [n for n, _ in block.named_parameters()]
    ref = reference(block, x, dy)
    flops = layer_flops(family, T, args.cpu_smoke) // (3 if args.inference else 1)
    print(f"\n=== {family} ({checkpoint}: H {H}) T={T}", flush=True)
    torch._dynamo.reset()
    timers, case_rows = {}, []
    for v in args.variants:
        row = dict(family=family, checkpoint=checkpoint, variant=v.name, settings=v.settings, T=T, flops=flops,
                   mode="fwd" if args.inference else "fwd+bwd", status="ok")
        case_rows.append(row)
        try:
            if v.base == "eager":
                fn = block
            elif v.base == "inductor":
                fn = torch.compile(block, backend="aot_eager" if args.cpu_smoke else "inductor", dynamic=False)
            else:
                options = {"moe_fuse.inner": "aot_eager"} if args.cpu_smoke else None
                fn = torch.compile(block, backend=common.moe_fuse_backend(v.settings), dynamic=False, options=options)

            def step(fn=fn):
                if args.inference:
                    with torch.no_grad():
                        return first(fn(x.unsqueeze(0))).reshape(x.shape)
                y = first(fn(x.unsqueeze(0))).reshape(x.shape)
                y.backward(dy)
                return y

            for t in leaves:
                t.grad = None
            with config.patch(v.settings), collect_reports() as reports:
                t0 = time.perf_counter()
                y = step()
                common.sync(dev)
                row["first_call_s"] = time.perf_counter() - t0
                row["peak_mb"] = common.peak_mem_mb(step, dev, leaves)
            if v.base == "moe_fuse":
                row["rewrites"] = common.rewrites(reports)
            got = [y.detach()] if args.inference else [y.detach(), x.grad] + [p.grad for p in block.parameters()]
            row["errors"] = {n: common.rel_err(g, r) for n, g, r in zip(names, got, ref)}
            row["worst_error"] = max(row["errors"].values())
            row["worst_at"] = max(row["errors"], key=row["errors"].get)
            timers[v.name] = lambda step=step, v=v: timed(step, v, dev, args, leaves)
        except Exception as e:  # an error row; the other variants and families still run
            print("    " + traceback.format_exc()[-1500:].replace("\n", "\n    "))
            row.update(status="error", error=f"{type(e).__name__}: {str(e).strip()[:300]}")
        print(f"  {v.name:28s} {row['status']:5s} worst err {common.fmt(row.get('worst_error'), '.2e')} "
              f"({row.get('worst_at')})" + (f" rewrites {row['rewrites']}" if "rewrites" in row else ""), flush=True)
    readings = common.in_turn(timers, args.rounds)
    for row in case_rows:
        if row["variant"] in readings:
            row["rounds_ms"] = [r["ms"] for r in readings[row["variant"]]]
            row["ms"] = statistics.median(row["rounds_ms"])
            row["tflops"] = row["flops"] / (row["ms"] * 1e-3) / 1e12
            row["pct_peak"] = 100 * row["tflops"] / peak["tflops"]
    rows += case_rows
    del block, ref


def timed(step, v, dev, args, leaves):
    with config.patch(v.settings):
        return common.time_ms(step, dev, grad_to_none=leaves, power=dev.type == "cuda", **common.timing(args.cpu_smoke))


def verdicts(rows):
    """Per family and T: (ok, why not)."""
    out = {}
    for key in dict.fromkeys((r["family"], r["T"]) for r in rows):
        case = {r["variant"]: r for r in rows if (r["family"], r["T"]) == key}
        bad = [f"{n}: {r['error'][:120]}" for n, r in case.items() if r["status"] == "error"]
        ind = case.get(PEER, {})
        for n, r in case.items():
            if r["status"] == "error" or not n.startswith("moe_fuse"):
                continue
            if not r.get("rewrites"):
                bad.append(f"{n} rewrote nothing")
            elif ind.get("worst_error") is not None and not r["worst_error"] <= 2 * ind["worst_error"] + 1e-3:
                bad.append(f"{n} error {r['worst_error']:.2e} > 2 x Inductor's {ind['worst_error']:.2e} + 1e-3")
        out[key] = (not bad, "; ".join(bad))
    return out


def markdown(rows, peak, meta, args):
    f = common.fmt
    mode = "forward (no grad)" if args.inference else "forward + backward"
    lines = [f"# families: one MoE layer of each family, {mode}, {meta['dtype']}", "", common.header(meta), "",
             f"ms: median of {args.rounds} round(s), the variants in turn. % peak: 6 T H (3 (k I + I_shared) + E)"
             f"{' / 3' if args.inference else ''} FLOPs over the {peak['n']}^3 matmul measured in the same run "
             f"({peak['tflops']:.1f} TFLOP/s). x inductor: Inductor's ms / this one's. Errors relative to the block in "
             "fp32 with the same routing: y, and the worst over y and every gradient. peak MB: what one step "
             "allocates over what was there before it.", ""]
    table = []
    for r in rows:
        case = {o["variant"]: o for o in rows if (o["family"], o["T"]) == (r["family"], r["T"])}
        peer = case.get(PEER, {}).get("ms")
        if r["status"] == "error":
            table.append([f"{r['family']} ({r['checkpoint']})", r["T"], r["variant"], "error: " + r["error"][:100]]
                         + [None] * 7)
            continue
        table.append([f"{r['family']} ({r['checkpoint']})", r["T"], r["variant"], f(r.get("ms"), ".3f"),
                      f(peer / r["ms"] if peer and r.get("ms") else None, ".2f"), f(r.get("pct_peak"), ".1f"),
                      f(r.get("peak_mb"), ".0f"), f(r["errors"]["y"], ".1e"), f(r["worst_error"], ".1e"),
                      f(r.get("first_call_s"), ".1f"), ", ".join(r.get("rewrites", [])) or None])
    lines.append(common.md_table(["family (sizes of)", "T", "variant", "ms", "x inductor", "% peak", "peak MB",
                                  "y err", "worst err", "first call s", "moe_fuse rewrites"], table))
    return "\n".join(lines)


def plot(rows):
    def draw(plt):
        cases = list(dict.fromkeys((r["family"], r["T"]) for r in rows))
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        ax = plt.subplots(figsize=(max(7, 1.4 * len(cases)), 4.5))[1]
        w = 0.8 / len(variants)
        for i, v in enumerate(variants):
            rs = [next((r for r in rows if (r["family"], r["T"], r["variant"]) == (*c, v)), {}) for c in cases]
            ax.bar([j + i * w for j in range(len(cases))], [r.get("pct_peak") or 0 for r in rs], w, label=v)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(cases))], [f"{f}\nT={T}" for f, T in cases], fontsize=7)
        ax.set_ylabel("% of the matmul peak (FLOPs the layer needs)")
        ax.legend(fontsize=7)
    return draw


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"of {', '.join(FAMILIES)}")
    ap.add_argument("--tokens", default="8192")
    ap.add_argument("--variants", default="eager,inductor,moe_fuse",
                    help="of eager, inductor, moe_fuse; moe_fuse:name=value[:name=value] under those moe_fuse.config settings")
    ap.add_argument("--inference", action="store_true", help="the forward alone under torch.no_grad, errors of y only")
    ap.add_argument("--rounds", type=int, default=1, help="time every variant this many times, in turn")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny fp32 blocks on the CPU (checks the script)")
    ap.add_argument("--out", default=str(common.RESULTS), help="folder for families_<gpu>.{md,json,png}")
    args = ap.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    try:
        args.variants = common.parse_variants(args.variants, BASES)
    except ValueError as e:
        ap.error(str(e))
    if args.cpu_smoke:
        dev, dtype, tokens = torch.device("cpu"), torch.float32, [32]
    elif torch.cuda.is_available():
        dev, dtype, tokens = torch.device("cuda"), torch.bfloat16, [int(t) for t in args.tokens.split(",")]
    else:
        sys.exit("no CUDA device: use --cpu-smoke")
    common.compile_setup()
    meta = dict(common.provenance(dev), dtype=str(dtype).replace("torch.", ""), inference=args.inference)
    peak = common.matmul_peak(dev, dtype)
    print(f"families: {common.header(meta)}\nmatmul peak {peak['tflops']:.1f} TFLOP/s", flush=True)
    rows = []
    try:
        for family in families:
            for T in tokens:
                run_family(family, T, dev, dtype, args, peak, rows)
    finally:  # a run cut short still writes what it measured
        md = markdown(rows, peak, meta, args)
        print("\n" + md)
        common.write_results("families", dev, args.out, dict(meta=meta, peak=peak, rows=rows), md, plot(rows))
    checks = verdicts(rows)
    for (family, T), (ok, why) in checks.items():
        print(f"{family} T={T}: {'ok' if ok else 'FAIL: ' + why}")
    return 0 if all(ok for ok, _ in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
