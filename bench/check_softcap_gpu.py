#!/usr/bin/env python3
"""Inkling 2's softcapped SwiGLU experts (``activation=reference.softcapped(Cg, Cu)``) on the GPU: the training
path against an fp32 reference, its cost against silu, and a compiled block with that gate against eager and
Inductor.

    PYTHONPATH=. python3 bench/check_softcap_gpu.py [--tokens 4096] [--block-tokens 16384] [--out DIR]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/check_softcap_gpu.py --cpu-smoke   # tiny fp32, checks the script

1. A Qwen3-30B-A3B-shaped experts layer (H 2048, I 768, E 128, k 8), bf16, h of about N(0, 1): the training
   path (grouped_mm_path, the only one with the softcaps) with Inkling 2's caps (4, 25), with caps that bend
   every value (1, 2), and with silu (the error scale of bf16 itself): relative L2 error of y and of every
   gradient against ``reference`` in fp32, and whether two runs are bitwise equal.
2. The op's forward + backward time with silu and with the caps, two passes in turn.
3. transformers' Qwen3-MoE block with its experts' gate spelled as Inkling 2's (``Inkling2SoftcappedSwiGLU``;
   transformers 5.17 has no Inkling 2): backend="moe_fuse" vs eager (errors of y and every gradient), then the
   forward + backward step of backend="moe_fuse" vs backend="inductor" (do_bench). Inductor computes the same
   gate in bf16 GEMMs around an fp32 pointwise kernel.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_fuse import reference  # noqa: E402
from moe_fuse.kernels import grouped_mm_path  # noqa: E402

SHAPES = {"30b": (2048, 768, 128, 8), "tiny": (64, 32, 8, 2)}  # H, I, E, k (layer_bench.py's)
CAPS = {"inkling2 (4, 25)": (4.0, 25.0), "bent (1, 2)": (1.0, 2.0)}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def case(T, shape, dev, dtype, seed=0):
    H, I, E, k = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    w, ids = torch.softmax(torch.randn(T, E, generator=gen), -1).topk(k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    wgu = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    wd = torch.randn(E, H, I, generator=gen) / I**0.5
    dy = torch.randn(T, H, generator=gen)
    return [t.to(dev, dtype) if t.is_floating_point() else t.to(dev) for t in (x, ids, w, wgu, wd, dy)]


def training_path(args, dy, activation):
    y, h, routing, xs, aw = grouped_mm_path.experts_forward(*args, save_h=True, keep_rows=True, activation=activation)
    return (y, *grouped_mm_path.experts_backward(dy, *args, h, routing=routing, xs=xs, aw=aw, activation=activation))


def check_paths(T, shape, dev, dtype, results):
    *args, dy = case(T, shape, dev, dtype)
    f32 = [t.float() if t.is_floating_point() else t for t in args]
    for label, activation in [*((k, reference.softcapped(*c)) for k, c in CAPS.items()), ("silu", "silu")]:
        want = (reference.experts_forward(*f32, activation=activation),
                *reference.experts_backward(dy.float(), *f32, activation=activation))
        got, again = training_path(args, dy, activation), training_path(args, dy, activation)
        errs = dict(zip(("y", "dx", "d_weights", "dW_gate_up", "dW_down"), (rel(g, r) for g, r in zip(got, want))))
        same = all(torch.equal(p, q) for p, q in zip(got, again))
        results["paths"][label] = {"errors": errs, "repeat_bitwise": same}
        print(f"  {label:<17} training path: " + "  ".join(f"{n} {e:.1e}" for n, e in errs.items())
              + f"  repeat bitwise: {same}")


def time_op(T, shape, results):
    from triton.testing import do_bench

    import moe_fuse.ops  # noqa: F401  (registers torch.ops.moe_fuse)

    x, ids, w, wgu, wd, dy = case(T, shape, "cuda", torch.bfloat16)
    rg = [t.requires_grad_() if t.is_floating_point() else t for t in (x, ids, w, wgu, wd)]
    for activation in ("silu", reference.softcapped(4.0, 25.0)) * 2:
        ms = do_bench(lambda: torch.ops.moe_fuse.experts(*rg, True, None, None, activation)[0].backward(dy),
                      warmup=10, rep=200, grad_to_none=[t for t in rg if t.is_floating_point()])
        results["op_ms"].setdefault(activation, []).append(ms)
        print(f"  fwd+bwd (the op, training path) {activation:<28}: {ms:.3f} ms")


def inkling_gate(caps):
    """Inkling 2's ``_apply_gate`` (Inkling2Experts, with Inkling2SoftcappedSwiGLU), spelled as transformers 5.24."""
    gate_cap, up_cap = caps

    def apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        dtype = gate.dtype
        gate, up = gate.float(), up.float()
        softcapped_gate = torch.tanh(gate / gate_cap) * gate_cap
        return (softcapped_gate * torch.sigmoid(gate) * (torch.tanh(up / up_cap) * up_cap)).to(dtype)

    return apply_gate


def block_check(T, shape, dev, dtype, smoke, results):
    from check_swiglu_limit_gpu import block_grads
    from layer_bench import SHAPES as BLOCK_SHAPES, build_block, ensure_moe_fuse_backend

    import moe_fuse

    ensure_moe_fuse_backend()
    BLOCK_SHAPES.setdefault(shape, SHAPES[shape])
    block = build_block(shape, dev, dtype)
    type(block.experts)._apply_gate = inkling_gate((4.0, 25.0))
    H = SHAPES[shape][0]
    x = torch.randn(1, T, H, device=dev, dtype=dtype, requires_grad=True)
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

    def grads(fn):
        return block_grads(fn, x, dy, params)

    eager = grads(block)
    torch._dynamo.reset()
    options = {"moe_fuse.inner": "aot_eager"} if smoke else None
    fused_fn = torch.compile(block, backend="moe_fuse", options=options)
    fused = grads(fused_fn)
    report = str(moe_fuse.explain(block, x))
    fused_lines = [line.strip() for line in report.splitlines() if line.strip().startswith("fused")]
    results["block"]["rewrites"] = fused_lines
    print("  compiled block:", "; ".join(fused_lines)[:600])
    names = ["y", "dx"] + [n for n, _ in block.named_parameters()]
    errs = {n: rel(a, b) for a, b, n in zip(fused, eager, names)}
    worst = max(errs.items(), key=lambda kv: kv[1])
    results["block"]["worst_vs_eager"] = worst
    print(f"  compiled block (softcaps 4, 25) T={T} vs eager {str(dtype)[6:]}: worst rel. error {worst[1]:.1e} "
          f"({worst[0]})")
    if smoke:
        return
    from triton.testing import do_bench

    torch._dynamo.reset()
    inductor_fn = torch.compile(block, backend="inductor")
    ind = grads(inductor_fn)
    worst = max(((rel(a, b), n) for a, b, n in zip(ind, eager, names)))
    results["block"]["inductor_worst_vs_eager"] = (worst[1], worst[0])
    print(f"  inductor block vs eager bf16: worst rel. error {worst[0]:.1e} ({worst[1]})")
    for r in range(2):
        ms = {name: do_bench(step(fn), warmup=25, rep=300, return_mode="median")
              for name, fn in (("inductor", inductor_fn), ("moe_fuse", fused_fn))}
        results["block"].setdefault("rounds_ms", []).append(ms)
        print(f"  round {r}: fwd+bwd inductor {ms['inductor']:.3f} ms, moe_fuse {ms['moe_fuse']:.3f} ms "
              f"({ms['inductor'] / ms['moe_fuse']:.2f}x)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--block-tokens", type=int, default=16384)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny fp32 shapes on the CPU (interpreter)")
    parser.add_argument("--out", type=Path, help="also write the results as check_softcap.json here")
    a = parser.parse_args()
    results = {"paths": {}, "op_ms": {}, "block": {}}
    if a.cpu_smoke:
        grouped_mm_path.RAGGED_MIN_ROWS = 0  # the interpreter's ragged GEMMs, as the tests run the path
        shape, dev, dtype, T, block_T = "tiny", "cpu", torch.float32, 64, 64
        print("CPU smoke (tiny fp32 shapes)")
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: use --cpu-smoke")
        shape, dev, dtype, T, block_T = "30b", "cuda", torch.bfloat16, a.tokens, a.block_tokens
        print(f"{torch.cuda.get_device_name()} T={T}")
    check_paths(T, shape, dev, dtype, results)
    if not a.cpu_smoke:
        time_op(T, shape, results)
    block_check(block_T, shape, dev, dtype, a.cpu_smoke, results)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "check_softcap.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
