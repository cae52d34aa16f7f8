#!/usr/bin/env python3
"""The clamped SwiGLU (``swiglu_limit``) and the GPT-OSS-style gate on it (``glu_alpha``) on the GPU: every
kernel path against an fp32 reference, and their cost.

    PYTHONPATH=. python3 bench/check_swiglu_limit_gpu.py [--tokens 4096] [--limit 1.0] [--alpha 1.702]

A Qwen3-30B-A3B-shaped experts layer (H 2048, I 768, E 128, k 8), bf16, h of about N(0, 1) so that a
limit of 1.0 clamps about a third of the gate and up values. Paths: the training path (grouped_mm_path:
CUTLASS / ragged GEMMs, the SwiGLU and dSwiGLU passes), the all-Triton forward without h (inference,
checkpointed layers: SwiGLU in the gate_up epilogue) and the all-Triton backward that recomputes h (the
dgrad epilogue). Each: relative L2 error of y and of every gradient against ``reference`` in fp32 with
the same limit, the same for the unclamped layer (the error scale of bf16 itself), and whether two runs
are bitwise equal. Then the training path's forward + backward time with and without the limit.
"""

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_fuse import kernels, reference  # noqa: E402
from moe_fuse.kernels import grouped_mm_path  # noqa: E402

H, I, E, K = 2048, 768, 128, 8


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def block_grads(fn, x, dy, params):
    """[out, then the gradient of each of params] of one forward + backward of a transformers block ``fn`` (an
    output tuple's first element) on x with output gradient dy; params' gradients reset first."""
    for p in params:
        p.grad = None
    out = fn(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(dy)
    return [out.detach().clone()] + [p.grad.clone() for p in params]


def case(T, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(T, E, device="cuda", generator=gen)
    w, ids = torch.softmax(logits, -1).topk(K, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).bfloat16()
    wgu = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H**0.5).bfloat16()
    wd = (torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5).bfloat16()
    dy = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    return x, ids, w, wgu, wd, dy


def paths(args, dy, limit, alpha=None):
    x, ids, w, wgu, wd = args
    out = {}
    gate = {"swiglu_limit": limit, "glu_alpha": alpha}
    y, h, routing, xs, aw = kernels.experts_forward(*args, save_h=True, keep_rows=True, **gate)
    grads = kernels.experts_backward(dy, *args, h, routing=routing, xs=xs, aw=aw, **gate)
    out["training path (grouped_mm_path)"] = (y, *grads)
    y_inf = kernels.experts_forward(*args, **gate)  # no h: the all-Triton forward
    grouped_mm_path.ENABLED = False
    try:
        g_rec = kernels.experts_backward(dy, *args, **gate)  # all-Triton, h recomputed
    finally:
        grouped_mm_path.ENABLED = True
    out["all-Triton (fwd without h, bwd recomputing h)"] = (y_inf, *g_rec)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--limit", type=float, default=1.0)
    parser.add_argument("--alpha", type=float, default=1.702)
    args_ = parser.parse_args()
    x, ids, w, wgu, wd, dy = case(args_.tokens)
    args = (x, ids, w, wgu, wd)
    lim_bf16 = reference.limit_in(torch.bfloat16, args_.limit)
    S = ids.numel()
    print(f"{torch.cuda.get_device_name()} T={args_.tokens} limit={args_.limit} (as bf16: {lim_bf16})")
    f32 = [t.float() if t.is_floating_point() else t for t in args]
    for limit, alpha in ((args_.limit, None), (args_.limit, args_.alpha), (None, None)):
        lim = None if limit is None else lim_bf16
        want_y = reference.experts_forward(*f32, swiglu_limit=lim, glu_alpha=alpha)
        want_g = reference.experts_backward(dy.float(), *f32, swiglu_limit=lim, glu_alpha=alpha)
        if limit is not None:
            h = kernels.experts_forward(*args, save_h=True)[1].float()  # [S, 2I]: gate | up
            print(f"  values clamped: gate {(h[:, :I] > lim).float().mean():.1%}, "
                  f"up {(h[:, I:].abs() > lim).float().mean():.1%} (of {S} rows)")
            del h
        first = paths(args, dy, limit, alpha)
        again = paths(args, dy, limit, alpha)
        for name, got in first.items():
            errs = [rel(g, r) for g, r in zip(got, (want_y, *want_g))]
            same = all(torch.equal(a, b) for a, b in zip(got, again[name]))
            print(f"  limit {limit!s:>4} alpha {alpha!s:>5}  {name:<48} y {errs[0]:.1e}  dx {errs[1]:.1e}  d_w {errs[2]:.1e}  "
                  f"dW_gu {errs[3]:.1e}  dW_d {errs[4]:.1e}  repeat bitwise: {same}")
        del want_y, want_g
    rg = [t.requires_grad_() if t.is_floating_point() else t for t in (x.clone(), ids, w.clone(), wgu, wd)]

    def step(gate):
        out = torch.ops.moe_fuse.experts(*rg, True, *gate)[0]
        out.backward(dy)

    import moe_fuse.ops  # noqa: F401

    for gate in ((), (args_.limit,), (args_.limit, args_.alpha)) * 2:
        ms = do_bench(lambda: step(gate), warmup=10, rep=200, grad_to_none=[t for t in rg if t.is_floating_point()])
        print(f"  fwd+bwd (the op, training path) gate args {gate!s:<13}: {ms:.3f} ms")
    compiled_block(args_.tokens, args_.limit, None)
    compiled_block(args_.tokens, args_.limit, args_.alpha)


def compiled_block(T, limit, alpha):
    """transformers' Qwen3-MoE block with its experts' gate swapped for the clamped SwiGLU (as the
    DeepSeek-V4 / GLM-5-Next / HY-V4 experts define it), eager vs backend="moe_fuse" (Inductor)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch.nn.functional as F
    from layer_bench import build_block, ensure_moe_fuse_backend

    import moe_fuse

    ensure_moe_fuse_backend()
    block = build_block("30b", "cuda", torch.bfloat16)
    experts_cls = type(block.experts)

    def clamped_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        if alpha is None:
            return F.silu(gate) * up
        return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))  # MiniMax-M3-VL's spelling

    experts_cls._apply_gate = clamped_gate
    # weights of N(0, 0.02^2) give h of ~N(0, 0.9^2) at H 2048: scale the limit to clamp as often as above
    block.experts.swiglu_limit = 0.9 * limit
    x = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    params = [x, *block.parameters()]

    def run(fn):
        return block_grads(fn, x, dy, params)

    eager = run(block)
    torch._dynamo.reset()
    fused = run(torch.compile(block, backend="moe_fuse"))
    report = str(moe_fuse.explain(block, x))
    print("  compiled block:", "; ".join(line.strip() for line in report.splitlines() if "fused" in line)[:600])
    names = ["y", "dx"] + [n for n, _ in block.named_parameters()]
    worst = max((rel(a, b), n) for a, b, n in zip(fused, eager, names))
    print(f"  compiled block (clamp at {block.experts.swiglu_limit}, alpha {alpha}) vs eager bf16: "
          f"worst rel. error {worst[0]:.1e} ({worst[1]})")


if __name__ == "__main__":
    main()
