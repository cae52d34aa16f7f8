#!/usr/bin/env python3
"""Llama 4's MoE layer (transformers' ``Llama4TextMoe``), forward + backward: HF eager, HF + Inductor and
moe_fuse side by side, same inputs, one process.

    python bench/llama4_layer_bench.py [--out DIR] [--tokens 4096,16384] [--quick] [--cpu-smoke]

The HF block runs every token through all E experts (scores 0 off the top-k) and sums; moe_fuse's
dense_experts pattern runs the k chosen experts only. Shape: Llama 4 Scout (H 5120, I 8192, E 16, top-1, a
shared expert of I 8192), bf16. "useful TFLOP/s" counts the FLOPs the layer needs (the chosen experts, the
shared expert and the router: 6 * T * H * (3 k I + 3 I + E) forward + backward), so the dense HF block's figure
is low by design. Errors: relative norm against the HF block in fp32 on the same inputs and with the bf16 block's
routing (T <= --ref-tokens), for y and the gradients of x and every parameter; gradients set to None before each
run. The peak is the memory one step allocates over what was allocated before it (weights, inputs).
"""
import argparse, json, math, os, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from layer_bench import bench, ensure_moe_fuse_backend, matmul_peak, peak_mem_mb, rel_err, sync  # noqa: E402
from provenance import code_version  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Llama4TextConfig  # noqa: E402
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe  # noqa: E402

SCOUT = dict(hidden_size=5120, intermediate_size=8192, num_local_experts=16, num_experts_per_tok=1)
TINY = dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=1)
VARIANTS = ["hf_eager", "hf_inductor", "moe_fuse"]
PEER = "hf_inductor"


def build(cfg, dev, dtype):
    torch.manual_seed(0)
    block = Llama4TextMoe(Llama4TextConfig(**cfg, hidden_act="silu"))
    with torch.no_grad():  # the experts start as zeros / uninitialised: random weights of a trained scale
        for p in block.parameters():
            p.normal_(0, p.shape[-2] ** -0.5 if p.dim() == 3 else p.shape[-1] ** -0.5)
    return block.to(dev, dtype)


def useful_flops(T, cfg):
    H, I, E, k = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"], cfg["num_experts_per_tok"]
    return 6 * T * H * (3 * k * I + 3 * I + E)


def compiled(name, block):
    torch._dynamo.reset()
    if name == "hf_eager":
        return block
    if name == "hf_inductor":
        return torch.compile(block, backend="inductor")
    return torch.compile(block, backend="moe_fuse")


def step_fn(fn, x, dy):
    def step():
        y = fn(x)[0]
        y.backward(dy)
        return y
    return step


def grads_of(block, x):
    return [x.grad] + [p.grad for p in block.parameters()]


class SameRouting(torch.nn.Module):
    """The bf16 block's router, its outputs upcast: the fp32 reference then picks the experts the bf16 block
    picks (an fp32 router flips near-tied top-1 choices, an error of the router's dtype, not of the experts)."""

    def __init__(self, router):
        super().__init__()
        self.inner = router

    def forward(self, h):
        return tuple(t.float() for t in self.inner(h.to(self.inner.weight.dtype)))


def reference(block, cfg, x, dy):
    """y and the gradients of x and every parameter of the HF block in fp32 with the bf16 block's routing; the
    router weight's gradient comes through that router (bf16 below the upcast)."""
    ref_block = build(cfg, x.device, torch.float32)
    ref_block.load_state_dict({k: v.float() for k, v in block.state_dict().items()})
    ref_block.router = SameRouting(block.router)
    block.router.weight.grad = None
    xr = x.detach().float().requires_grad_(True)
    y = ref_block(xr)[0]
    y.backward(dy.float())
    grads = {n.replace("router.inner.", "router."): p.grad for n, p in ref_block.named_parameters()}
    out = [y.detach(), xr.grad] + [grads[n].float() for n, _ in block.named_parameters()]
    block.router.weight.grad = None
    return out


def run_case(T, cfg, dev, dtype, args, rows, peak):
    H = cfg["hidden_size"]
    block = build(cfg, dev, dtype)
    gen = torch.Generator(device="cpu").manual_seed(T)
    x = torch.randn(T, H, generator=gen).to(dev, dtype).requires_grad_(True)
    dy = torch.randn(T, H, generator=gen).to(dev, dtype)
    leaves = [x, *block.parameters()]
    ref = None
    if T <= args.ref_tokens:
        ref = reference(block, cfg, x, dy)
    names = ["y", "x"] + [n for n, _ in block.named_parameters()]
    for name in VARIANTS:
        row = {"variant": name, "T": T}
        try:
            if name == "moe_fuse":  # before the timed compile: explain resets Dynamo
                from moe_fuse import explain
                row["rewrites"] = [m["pattern"] for m in explain(block, x.detach()).matches]
            fn = compiled(name, block)
            step = step_fn(fn, x, dy)
            for t in leaves:
                t.grad = None
            y = step()  # compiles; poison-free: fresh grads
            if ref is not None:
                got = [y.detach()] + grads_of(block, x)
                row["errors"] = {n: rel_err(g, r) for n, g, r in zip(names, got, ref)}
                row["worst_error"] = max(row["errors"].values())
            row["peak_mb"] = peak_mem_mb(step, dev, leaves)
            ms, p20, p80 = bench(step, dev, args.quick, grad_to_none=leaves, row=row)
            row.update(ms=ms, p20=p20, p80=p80)
            row["useful_tflops"] = useful_flops(T, cfg) / (ms * 1e-3) / 1e12
            row["pct_peak"] = 100 * row["useful_tflops"] / peak["tflops"]
        except Exception as e:  # an error row, not a crash: the other variants still run
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
        print(fmt(row), flush=True)
    torch._dynamo.reset()


def fmt(r):
    if "error" in r:
        return f"T={r['T']:>6} {r['variant']:<12} ERROR {r['error'][:300]}"
    err = f" worst err {r['worst_error']:.2e}" if "worst_error" in r else ""
    rw = f" rewrites {r['rewrites']}" if "rewrites" in r else ""
    mem = f" peak {r['peak_mb']:.0f} MB" if r.get("peak_mb") is not None else ""
    return (f"T={r['T']:>6} {r['variant']:<12} {r['ms']:9.3f} ms  {r['useful_tflops']:6.1f} useful TFLOP/s "
            f"({r['pct_peak']:.1f}% of peak){mem}{err}{rw}")


def table(rows):
    lines = ["| T | variant | ms fwd+bwd | x vs HF + Inductor | x vs HF eager | useful TFLOP/s | % of peak | peak MB | "
             "worst rel. err vs fp32 |", "|---|---|---|---|---|---|---|---|---|"]
    for T in sorted({r["T"] for r in rows}):
        case = {r["variant"]: r for r in rows if r["T"] == T and "ms" in r}
        for name, r in case.items():
            vs = lambda other: f"{case[other]['ms'] / r['ms']:.2f}" if other in case else "-"  # noqa: E731
            err = f"{r['worst_error']:.2e}" if "worst_error" in r else "-"
            mem = f"{r['peak_mb']:.0f}" if r.get("peak_mb") is not None else "-"
            lines.append(f"| {T} | {name} | {r['ms']:.3f} | {vs(PEER)} | {vs('hf_eager')} | {r['useful_tflops']:.1f} | "
                         f"{r['pct_peak']:.1f} | {mem} | {err} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--ref-tokens", type=int, default=4096, help="largest T checked against the fp32 block")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny fp32 Llama 4 layer on the CPU")
    args = ap.parse_args()
    ensure_moe_fuse_backend()
    if args.cpu_smoke:
        dev, dtype, cfg, tokens = torch.device("cpu"), torch.float32, TINY, [64]
        args.quick = True
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: use --cpu-smoke")
        dev, dtype, cfg = torch.device("cuda"), torch.bfloat16, SCOUT
        tokens = [int(t) for t in args.tokens.split(",")]
    peak = matmul_peak(dev, dtype, args.quick)
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(dev),
            "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None, "config": cfg, "peak": peak,
            "code": code_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"matmul peak {peak['tflops']:.1f} TFLOP/s ({dtype}); {meta['gpu'] or 'cpu'}; torch {torch.__version__}, "
          f"transformers {transformers.__version__}", flush=True)
    rows = []
    for T in tokens:
        run_case(T, cfg, dev, dtype, args, rows, peak)
        sync(dev)
    print(table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "llama4_layer_bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    (out / "llama4_layer_bench.md").write_text(table(rows) + "\n")
    bad = [r for r in rows if "error" in r or not r.get("worst_error", 0) < 2e-2 or
           (r["variant"] == "moe_fuse" and "dense_experts" not in r.get("rewrites", []))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
