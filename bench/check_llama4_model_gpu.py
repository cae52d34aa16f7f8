#!/usr/bin/env python3
"""A whole Llama4ForCausalLM (text), bf16 on the GPU: backend="moe_fuse" against eager and backend="inductor".

    PYTHONPATH=. python3 bench/check_llama4_model_gpu.py [--layers 2] [--seq 4096] [--cpu-smoke]

Checks the end-to-end path the CPU tests cannot: Llama 4's attention, norms and MoE layers compiled together on
CUDA, the dense_experts rewrite in every MoE layer, and the training step's loss and gradients against eager
(relative norms; bf16 on both sides, so the figure to read is moe_fuse's next to Inductor's). Then the forward +
backward of one step, timed with do_bench. Scout's layer shape (H 5120, I 8192, E 16, top-1), a smaller
vocabulary (32000) so that several layers fit with their gradients.
"""
import argparse, json, os, shutil, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from layer_bench import bench, ensure_moe_fuse_backend, rel_err  # noqa: E402
from provenance import code_version  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Llama4ForCausalLM, Llama4TextConfig  # noqa: E402

SCOUT = dict(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_local_experts=16,
             num_experts_per_tok=1, num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=32000)
TINY = dict(hidden_size=64, intermediate_size=32, intermediate_size_mlp=64, num_local_experts=8, num_experts_per_tok=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)


def build(cfg, layers, dev, dtype):
    torch.manual_seed(0)
    config = Llama4TextConfig(**cfg, num_hidden_layers=layers, interleave_moe_layer_step=1, use_cache=False,
                              attn_implementation="sdpa")
    model = Llama4ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # the experts start as zeros / uninitialised: random weights of a trained scale
            if p.dim() == 3:
                p.normal_(0, p.shape[-2] ** -0.5)
    return model.to(dev, dtype).train()


def step(model, ids):
    def run():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    args = ap.parse_args()
    ensure_moe_fuse_backend()
    if args.cpu_smoke:
        dev, dtype, cfg, args.seq = torch.device("cpu"), torch.float32, TINY, 32
    else:
        dev, dtype, cfg = torch.device("cuda"), torch.bfloat16, SCOUT
    model = build(cfg, args.layers, dev, dtype)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab_size"], (args.batch, args.seq), generator=gen).to(dev)
    names = [n for n, _ in model.named_parameters()]

    results = {"meta": {"torch": torch.__version__, "transformers": transformers.__version__, "layers": args.layers,
                        "tokens": args.batch * args.seq, "config": cfg, "code": code_version()}, "rows": []}
    want = None
    shutil.rmtree(Path(args.out) / "moe_fuse_debug", ignore_errors=True)  # the rewrites counted are this run's
    for backend in ("eager", "inductor", "moe_fuse"):
        torch._dynamo.reset()
        opts = {"moe_fuse.debug_dir": str(Path(args.out) / "moe_fuse_debug")} if backend == "moe_fuse" else None
        fn = model if backend == "eager" else torch.compile(model, backend=backend, options=opts)
        run = step(fn, ids)
        loss = run().detach().float()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        row = {"backend": backend, "loss": loss.item()}
        if want is None:
            want = (loss, grads)
        else:
            errs = {n: rel_err(g, w) for n, g, w in zip(names, grads, want[1])}
            row["loss_rel_err"] = abs(loss.item() - want[0].item()) / abs(want[0].item())
            row["worst_grad"] = max(errs.items(), key=lambda kv: kv[1])
            row["experts_grads"] = {n: e for n, e in errs.items() if "experts" in n}
        if backend == "moe_fuse":
            reports = [json.loads(p.read_text()) for p in sorted((Path(args.out) / "moe_fuse_debug").glob("*/report.json"))]
            row["rewrites"] = [m["pattern"] for r in reports for m in r["matches"]]
            row["rejected"] = [(r_["pattern"], r_["reason"]) for r in reports for r_ in r["rejected"]]
        del grads
        row["ms"] = bench(run, dev, quick=args.cpu_smoke)[0]
        results["rows"].append(row)
        print(json.dumps(row, default=str), flush=True)
    base = {r["backend"]: r["ms"] for r in results["rows"]}
    print(f"fwd+bwd ms: eager {base['eager']:.2f}, inductor {base['inductor']:.2f}, moe_fuse {base['moe_fuse']:.2f} "
          f"({base['inductor'] / base['moe_fuse']:.2f}x Inductor, {base['eager'] / base['moe_fuse']:.2f}x eager)")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "check_llama4_model.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
