#!/usr/bin/env python3
"""A training step of a whole model: transformers' Qwen3MoeForCausalLM with Qwen3-30B-A3B's layer shapes, eager
vs Inductor vs moe_fuse, with and without activation checkpointing, fed as users feed it: no attention mask,
a tokenizer's all-ones mask, or right padding (10-30% of each row; labels -100 there, as a data collator sets).

    python bench/train_step.py [--layers 6] [--tokens 8192] [--seq 8192] [--variants eager,inductor,moe_fuse]
                               [--ckpt off,on] [--mask none,ones,pad] [--steps 5] [--out DIR]
    python bench/train_step.py --cpu-smoke     # tiny model on the CPU, Inductor replaced by aot_eager

Per (ckpt, variant): a fresh model from one seed (the same weights), the same token ids (labels = ids), AdamW.
The first step's wall time (compile), --steps training steps (their losses must agree across variants), then
forward + backward, the AdamW step, and the whole step (zero_grad, forward, backward, AdamW) timed (bench/common.py),
tokens/s and the peak memory of the step.
``moe_fuse:name=value`` runs moe_fuse under ``moe_fuse.config.patch(name=value)``. Writes train_step_<gpu>.{md,json,png}.
"""
from __future__ import annotations

import argparse
import collections
import gc
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the checkout on sys.path)

import torch  # noqa: E402
from moe_fuse import config  # noqa: E402

# Qwen3-30B-A3B (its config.json), layer count and vocabulary as given
FULL = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
            num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4,
            head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False)
BASES = ["eager", "inductor", "moe_fuse"]
SEED, INIT_STD, LR = 0, 0.02, 1e-3  # LR large enough that bf16 weights move: the losses show sane gradients


def make_config(args):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(num_hidden_layers=args.layers, use_cache=False, output_router_logits=False,
                          experts_implementation="grouped_mm", **(TINY if args.cpu_smoke else FULL))


def build_model(cfg, dev, dtype, ckpt):
    """The same seed, the same weights: every 2-D parameter (the router's too, which transformers starts at zero)
    from N(0, INIT_STD^2)."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(SEED)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters born in dtype; the rotary inv_freq stays fp32
    try:
        with torch.device(dev):
            model = Qwen3MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    gen = torch.Generator(device=dev).manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, INIT_STD, generator=gen)
    model.train()
    if ckpt:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    if getattr(model.config, "_experts_implementation", None) != "grouped_mm":
        model.set_experts_implementation("grouped_mm")
    return model


def model_flops(cfg, tokens, seq):
    """Matmul FLOPs of one forward (causal attention counted half; checkpointing's recompute not counted)."""
    H, I, E, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    nh, nkv, hd, V = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size
    per_token_layer = (2 * (H * nh * hd + 2 * H * nkv * hd + nh * hd * H)  # q, k, v, o
                       + 2 * H * E + 2 * k * 3 * H * I                        # router, experts
                       + 2 * seq * nh * hd)                                   # QK^T and PV, causal half
    return tokens * (cfg.num_hidden_layers * per_token_layer + 2 * H * V)


def batch_inputs(ids, mask):
    """The model's keyword inputs for one mask kind: none, ones (a tokenizer's mask of an unpadded batch) or pad
    (right padding: row b keeps 90% down to 70% of its tokens; padded labels are -100, as a collator sets)."""
    if mask == "none":
        return dict(input_ids=ids, labels=ids)
    attention_mask = torch.ones_like(ids)
    labels = ids.clone()
    if mask == "pad":
        batch, seq = ids.shape
        for b in range(batch):
            pad = int(seq * (0.1 + 0.2 * b / max(batch - 1, 1)))
            attention_mask[b, seq - pad:] = 0
            labels[b, seq - pad:] = -100
    return dict(input_ids=ids, labels=labels, attention_mask=attention_mask)


def run_variant(v, ckpt, cfg, ids, dev, dtype, args, row):
    from moe_fuse.debug import collect_reports

    model = build_model(cfg, dev, dtype, ckpt)
    params = list(model.parameters())
    fused = dict(fused=True) if dev.type == "cuda" else dict(foreach=True)
    opt = torch.optim.AdamW(params, lr=LR, **fused)
    if v.base == "eager":
        fn = model
    elif v.base == "inductor":
        fn = torch.compile(model, backend="aot_eager" if args.cpu_smoke else "inductor", dynamic=False)
    else:
        options = {"moe_fuse.inner": "aot_eager"} if args.cpu_smoke else None
        fn = torch.compile(model, backend=common.moe_fuse_backend(v.settings), dynamic=False, options=options)

    inputs = batch_inputs(ids, row["mask"])

    def fwd_bwd():
        loss = fn(**inputs, use_cache=False).loss
        loss.backward()
        return loss.detach()

    def whole_step():
        opt.zero_grad(set_to_none=True)
        fwd_bwd()
        opt.step()

    torch._dynamo.utils.counters.clear()
    with config.patch(v.settings), collect_reports() as reports:
        t0 = time.perf_counter()
        losses = [fwd_bwd()]
        common.sync(dev)
        row["first_step_s"] = time.perf_counter() - t0
        if v.base == "moe_fuse":
            row["rewrites"] = dict(collections.Counter(common.rewrites(reports)))
        counters = torch._dynamo.utils.counters
        if v.base != "eager":
            row["graphs"] = counters["stats"].get("unique_graphs", 0)
            row["graph_breaks"] = sum(counters["graph_break"].values())
        opt.step()
        for _ in range(args.steps):
            opt.zero_grad(set_to_none=True)
            losses.append(fwd_bwd())
            opt.step()
        row["losses"] = [float(x) for x in torch.stack(losses).float().cpu()]
        timing = common.timing(args.cpu_smoke, 1000)
        fb = common.time_ms(fwd_bwd, dev, grad_to_none=params, power=dev.type == "cuda", **timing)
        row.update(fwdbwd_ms=fb["ms"], fwdbwd_p20=fb["p20"], fwdbwd_p80=fb["p80"], power=fb.get("power"))
        row["adamw_ms"] = common.time_ms(opt.step, dev, **timing)["ms"]
        row["step_ms"] = common.time_ms(whole_step, dev, **timing)["ms"]
        if dev.type == "cuda":
            opt.zero_grad(set_to_none=True)
            torch.cuda.reset_peak_memory_stats(dev)
            fwd_bwd()
            common.sync(dev)
            row["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30  # weights, grads, AdamW state included
    row["tok_s"] = ids.numel() / (row["fwdbwd_ms"] * 1e-3)
    row["tflops"] = 3 * model_flops(cfg, ids.numel(), ids.shape[1]) / (row["fwdbwd_ms"] * 1e-3) / 1e12
    if v.base != "eager":
        row["compile_s"] = row["first_step_s"] - row["fwdbwd_ms"] * 1e-3
    print(f"    fwd+bwd {row['fwdbwd_ms']:.2f} ms, AdamW {row['adamw_ms']:.2f} ms, step {row['step_ms']:.2f} ms, "
          f"{row['tok_s']:.0f} tok/s, peak "
          f"{common.fmt(row.get('peak_gib'), '.2f')} GiB, losses {row['losses'][0]:.5f} -> {row['losses'][-1]:.5f}"
          + (f", rewrites {row['rewrites']}" if "rewrites" in row else ""), flush=True)


def derive(rows, tol):
    ok = {(r["variant"], r["ckpt"], r["mask"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        for peer in ("eager", "inductor"):
            p = ok.get((peer, r["ckpt"], r["mask"]))
            r[f"x_{peer}"] = p["fwdbwd_ms"] / r["fwdbwd_ms"] if p else None
            r[f"step_x_{peer}"] = p["step_ms"] / r["step_ms"] if p else None
        p = ok.get(("inductor", r["ckpt"], r["mask"]))
        r["mem_vs_inductor"] = r["peak_gib"] / p["peak_gib"] if p and r.get("peak_gib") and p.get("peak_gib") else None
        ref = ok.get(("eager", r["ckpt"], r["mask"]))
        if ref:
            r["first_loss_rel_diff"] = abs(r["losses"][0] - ref["losses"][0]) / abs(ref["losses"][0])
            r["loss_ok"] = r["first_loss_rel_diff"] <= tol
            if r["loss_ok"] is False:
                r["status"] = "FAIL"


def markdown(rows, meta):
    f = common.fmt
    lines = [f"# train_step: Qwen3MoeForCausalLM, {meta['model']} x{meta['layers']} layers, {meta['tokens']} tokens a "
             f"step (batch {meta['batch']} x seq {meta['seq']})", "", common.header(meta), "",
             f"{meta['params']:,} {meta['dtype']} parameters, torch's fused AdamW. mask: none, ones (a tokenizer's "
             "mask of an unpadded batch) or pad (right padding, 10-30% of each row). fwd+bwd: forward with the loss "
             "over the whole vocabulary, then backward (median); AdamW timed apart; step: zero_grad, forward, "
             "backward and AdamW timed together. x eager / x inductor: their ms / this one's, same ckpt and mask "
             "(fwd+bwd; step). peak: the most memory allocated during fwd+bwd (weights, gradients and AdamW "
             "state included). compile: the first step's wall time less a step. loss diff: the first loss against "
             "eager's, relative.", ""]
    table = []
    for r in rows:
        if r["status"] not in ("ok", "FAIL"):
            table.append([r["mask"], r["ckpt"], r["variant"], r["status"], (r.get("error") or "")[:120]] + [None] * 11)
            continue
        table.append([r["mask"], r["ckpt"], r["variant"], r["status"], f(r["fwdbwd_ms"], ".2f"),
                      f(r["adamw_ms"], ".2f"), f(r["step_ms"], ".2f"), f(r["tok_s"], ".0f"), f(r["tflops"], ".3g"),
                      f(r.get("peak_gib"), ".2f"), f(r.get("x_eager"), ".2f"), f(r.get("x_inductor"), ".2f"),
                      f(r.get("step_x_inductor"), ".2f"), f(r.get("mem_vs_inductor"), ".2f"), f(r.get("compile_s"), ".1f"),
                      f(r.get("first_loss_rel_diff"), ".1e")])
    lines.append(common.md_table(["mask", "ckpt", "variant", "status", "fwd+bwd ms", "AdamW ms", "step ms", "tok/s",
                                  "TFLOP/s", "peak GiB", "x eager", "x inductor", "step x inductor", "mem / inductor",
                                  "compile s", "loss diff"], table))
    ok = [r for r in rows if r.get("losses")]
    if ok:
        n = max(len(r["losses"]) for r in ok)
        lines += ["", "Loss after each step (step 0: before any AdamW update):", "",
                  common.md_table(["mask", "ckpt", "variant"] + [str(i) for i in range(n)],
                                  [[r["mask"], r["ckpt"], r["variant"]] + [f"{x:.4f}" for x in r["losses"]] for r in ok])]
    rewritten = [r for r in rows if r.get("rewrites") is not None]
    if rewritten:
        lines += ["", "moe_fuse rewrites: " + "; ".join(
            f"{r['variant']} mask {r['mask']} ckpt {r['ckpt']}: {r['rewrites'] or 'none'}" for r in rewritten)]
    return "\n".join(lines)


def plot(rows):
    ok = [r for r in rows if r.get("fwdbwd_ms")]

    def draw(plt):
        mem = any(r.get("peak_gib") for r in ok)
        fig, axes = plt.subplots(1, 1 + mem, figsize=(6 * (1 + mem), 4.5), squeeze=False)
        labels = [f"{r['variant']}\n{r['mask']}, ckpt {r['ckpt']}" for r in ok]
        ax = axes[0][0]
        bars = ax.bar(range(len(ok)), [r["fwdbwd_ms"] for r in ok], label="fwd+bwd")
        ax.bar(range(len(ok)), [r["step_ms"] - r["fwdbwd_ms"] for r in ok], bottom=[r["fwdbwd_ms"] for r in ok],
               label="rest of the step (AdamW, zero_grad)")
        ax.bar_label(bars, [f"{r['fwdbwd_ms']:.0f}" for r in ok], label_type="center", fontsize=7)
        ax.set_xticks(range(len(ok)), labels, fontsize=7)
        ax.set_ylabel("ms per step (median)")
        ax.legend(fontsize=7)
        if mem:
            ax = axes[0][1]
            bars = ax.bar(range(len(ok)), [r.get("peak_gib") or 0 for r in ok], color="tab:gray")
            ax.bar_label(bars, [f"{r.get('peak_gib') or 0:.1f}" for r in ok], fontsize=7)
            ax.set_xticks(range(len(ok)), labels, fontsize=7)
            ax.set_ylabel("peak GiB, fwd+bwd")

    return draw if ok else None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 6; --cpu-smoke 2)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens a step, batch x seq (default 8192; --cpu-smoke 64)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: --tokens, batch 1; --cpu-smoke 32)")
    ap.add_argument("--variants", default="eager,inductor,moe_fuse",
                    help="of eager, inductor, moe_fuse; moe_fuse:name=value[:name=value] under those moe_fuse.config settings")
    ap.add_argument("--ckpt", default="off,on", help="activation checkpointing: off, on or off,on")
    ap.add_argument("--mask", default="none", help="attention mask: of none, ones, pad (comma-separated)")
    ap.add_argument("--steps", type=int, default=5, help="training steps after the first (their losses are compared)")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="skip the variants that would end past this many seconds (0: no limit)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU (checks the script)")
    ap.add_argument("--out", default=str(common.RESULTS), help="folder for train_step_<gpu>.{md,json,png}")
    args = ap.parse_args(argv)
    args.layers = args.layers or (2 if args.cpu_smoke else 6)
    args.tokens = args.tokens or (64 if args.cpu_smoke else 8192)
    args.seq = args.seq or (min(32, args.tokens) if args.cpu_smoke else args.tokens)
    if args.tokens % args.seq:
        ap.error(f"--tokens {args.tokens} is not a multiple of --seq {args.seq}")
    try:
        args.variants = common.parse_variants(args.variants, BASES)
    except ValueError as e:
        ap.error(str(e))
    args.ckpt = [c for c in args.ckpt.split(",") if c]
    if set(args.ckpt) - {"off", "on"}:
        ap.error("--ckpt takes off, on or off,on")
    args.mask = [m for m in args.mask.split(",") if m]
    if not args.mask or set(args.mask) - {"none", "ones", "pad"}:
        ap.error("--mask takes none, ones, pad, comma-separated")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.cpu_smoke:
        dev, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(1)  # tiny ops gain nothing from threads, and lose much on a busy machine
    elif torch.cuda.is_available():
        dev, dtype = torch.device("cuda"), torch.bfloat16
    else:
        sys.exit("no CUDA device: use --cpu-smoke")
    common.compile_setup()
    tol = 1e-4 if dtype == torch.float32 else 5e-3
    cfg = make_config(args)
    batch = args.tokens // args.seq
    ids = torch.randint(0, cfg.vocab_size, (batch, args.seq), generator=torch.Generator().manual_seed(SEED + 1)).to(dev)
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        n_params = sum(p.numel() for p in Qwen3MoeForCausalLM(cfg).parameters())
    meta = dict(common.provenance(dev), dtype=str(dtype).replace("torch.", ""),
                model="tiny" if args.cpu_smoke else "Qwen3-30B-A3B", layers=args.layers, tokens=args.tokens,
                batch=batch, seq=args.seq, params=n_params, steps=args.steps, lr=LR, loss_tol=tol)
    print(f"train_step: {common.header(meta)}", flush=True)
    rows, t_start, took = [], time.monotonic(), {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("SIGTERM: writing what was measured"))
    try:
        for mask, ckpt in [(m, c) for m in args.mask for c in args.ckpt]:
            for v in args.variants:
                row = dict(variant=v.name, settings=v.settings, mask=mask, ckpt=ckpt, status="ok")
                rows.append(row)
                used = time.monotonic() - t_start
                guess = took.get(v.name, max(took.values(), default=0.0))
                if args.budget_s and used + guess > args.budget_s:
                    row.update(status="skipped", error=f"budget: {used:.0f} s used, next about {guess:.0f} s")
                    continue
                print(f"\n=== {v.name} mask {mask} ckpt {ckpt} ({used:.0f} s in)", flush=True)
                t0 = time.monotonic()
                try:
                    run_variant(v, ckpt == "on", cfg, ids, dev, dtype, args, row)
                except Exception as e:  # out of memory, a compile error: recorded, the others still run
                    tb = traceback.format_exc()
                    print("    " + tb[-2000:].replace("\n", "\n    "))
                    row.update(status="error", error=f"{type(e).__name__}: {str(e).strip()[:300]}", traceback=tb[-6000:])
                gc.collect()
                torch._dynamo.reset()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                took[v.name] = max(took.get(v.name, 0.0), time.monotonic() - t0)
    finally:
        derive(rows, tol)
        meta["total_s"] = time.monotonic() - t_start
        md = markdown(rows, meta)
        print("\n" + md)
        common.write_results("train_step", dev, args.out, dict(meta=meta, rows=rows), md, plot(rows))
    return 1 if any(r["status"] in ("FAIL", "error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
