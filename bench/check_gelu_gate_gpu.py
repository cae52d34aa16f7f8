#!/usr/bin/env python3
"""GeGLU experts (``activation="gelu_tanh"``, Gemma 4) on the GPU: every kernel path against an fp32
reference, and a compiled transformers block with that gate against eager and against Inductor.

    PYTHONPATH=. python3 bench/check_gelu_gate_gpu.py [--tokens 4096] [--block-tokens 16384]

1. A Qwen3-30B-A3B-shaped experts layer (H 2048, I 768, E 128, k 8), bf16: the training path
   (grouped_mm_path) and the all-Triton path (forward without h, backward recomputing h), each with
   gelu_tanh and with silu (the error scale of bf16 itself): relative L2 error of y and of every gradient
   against ``reference`` in fp32, and whether two runs are bitwise equal.
2. The op's forward + backward time with each activation, two passes in turn.
3. transformers' Qwen3-MoE block with its experts' ``act_fn`` set to transformers' ``gelu_pytorch_tanh``
   (what Gemma 4's experts use, same layout): backend="moe_fuse" vs eager bf16 (errors of y and every
   gradient), then the forward + backward step of backend="moe_fuse" vs backend="inductor" (do_bench).
"""

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from check_swiglu_limit_gpu import H, case, rel  # noqa: E402
from moe_fuse import kernels, reference  # noqa: E402
from moe_fuse.kernels import grouped_mm_path  # noqa: E402


def paths(args, dy, activation):
    out = {}
    y, h, routing, xs, aw = kernels.experts_forward(*args, save_h=True, keep_rows=True, activation=activation)
    grads = kernels.experts_backward(dy, *args, h, routing=routing, xs=xs, aw=aw, activation=activation)
    out["training path (grouped_mm_path)"] = (y, *grads)
    y_inf = kernels.experts_forward(*args, activation=activation)  # no h: the all-Triton forward
    grouped_mm_path.ENABLED = False
    try:
        g_rec = kernels.experts_backward(dy, *args, activation=activation)  # all-Triton, h recomputed
    finally:
        grouped_mm_path.ENABLED = True
    out["all-Triton (fwd without h, bwd recomputing h)"] = (y_inf, *g_rec)
    return out


def block_check(T):
    from layer_bench import build_block, ensure_moe_fuse_backend
    from transformers.activations import ACT2FN

    import moe_fuse

    ensure_moe_fuse_backend()
    block = build_block("30b", "cuda", torch.bfloat16)
    block.experts.act_fn = ACT2FN["gelu_pytorch_tanh"]
    x = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    params = [x, *block.parameters()]

    def step(fn):
        def run():
            for p in params:
                p.grad = None
            out = fn(x)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(dy)
            return out
        return run

    def results(run):
        out = run()
        return [out.detach().clone()] + [p.grad.clone() for p in params]

    eager = results(step(block))
    torch._dynamo.reset()
    fused_fn = torch.compile(block, backend="moe_fuse")
    fused = results(step(fused_fn))
    report = str(moe_fuse.explain(block, x))
    print("  compiled block:", "; ".join(line.strip() for line in report.splitlines() if "fused" in line)[:400])
    names = ["y", "dx"] + [n for n, _ in block.named_parameters()]
    worst = max((rel(a, b), n) for a, b, n in zip(fused, eager, names))
    print(f"  compiled block (gelu_pytorch_tanh) T={T} vs eager bf16: worst rel. error {worst[0]:.1e} ({worst[1]})")
    torch._dynamo.reset()
    inductor_fn = torch.compile(block, backend="inductor")
    ind = results(step(inductor_fn))
    worst = max((rel(a, b), n) for a, b, n in zip(ind, eager, names))
    print(f"  inductor block vs eager bf16: worst rel. error {worst[0]:.1e} ({worst[1]})")
    for r in range(2):
        ms = {name: do_bench(step(fn), warmup=25, rep=300, return_mode="median")
              for name, fn in (("inductor", inductor_fn), ("moe_fuse", fused_fn))}
        print(f"  round {r}: fwd+bwd inductor {ms['inductor']:.3f} ms, moe_fuse {ms['moe_fuse']:.3f} ms "
              f"({ms['inductor'] / ms['moe_fuse']:.2f}x)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--block-tokens", type=int, default=16384)
    a = parser.parse_args()
    x, ids, w, wgu, wd, dy = case(a.tokens)
    args = (x, ids, w, wgu, wd)
    print(f"{torch.cuda.get_device_name()} T={a.tokens}")
    f32 = [t.float() if t.is_floating_point() else t for t in args]
    for activation in ("gelu_tanh", "silu"):
        want = (reference.experts_forward(*f32, activation=activation),
                *reference.experts_backward(dy.float(), *f32, activation=activation))
        first, again = paths(args, dy, activation), paths(args, dy, activation)
        for name, got in first.items():
            errs = [rel(g, r) for g, r in zip(got, want)]
            same = all(torch.equal(p, q) for p, q in zip(got, again[name]))
            print(f"  {activation:<9} {name:<48} y {errs[0]:.1e}  dx {errs[1]:.1e}  d_w {errs[2]:.1e}  "
                  f"dW_gu {errs[3]:.1e}  dW_d {errs[4]:.1e}  repeat bitwise: {same}")
        del want
    import moe_fuse.ops  # noqa: F401

    rg = [t.requires_grad_() if t.is_floating_point() else t for t in (x.clone(), ids, w.clone(), wgu, wd)]

    def op_step(activation):
        torch.ops.moe_fuse.experts(*rg, True, None, None, activation)[0].backward(dy)

    for activation in ("silu", "gelu_tanh") * 2:
        ms = do_bench(lambda: op_step(activation), warmup=10, rep=200,
                      grad_to_none=[t for t in rg if t.is_floating_point()])
        print(f"  fwd+bwd (the op, training path) {activation:<9}: {ms:.3f} ms")
    block_check(a.block_tokens)


if __name__ == "__main__":
    main()
