#!/usr/bin/env python3
"""Experts without a gate (``activation="relu2"``, Nemotron-H) on the GPU: checks, then moe_fuse beside the same
math compiled by Inductor.

    PYTHONPATH=. python3 bench/check_ungated_gpu.py [--tokens 4096,16384]
    PYTHONPATH=. python3 bench/check_ungated_gpu.py --cpu-smoke     # the script itself, tiny bf16 on the CPU

Shapes: H 2688, E 128, k 6 (Nemotron-3-Nano-30B-A3B's), I 1856; bf16; routing weights of a softmax over the
top-k logits. Per token count:
1. (first T only) y and every gradient of the op (on CUDA sm90: grouped_mm_path with kernels/ungated.py)
   against ``reference`` in fp32, beside the same errors of transformers' bf16 grouped_mm math in eager
   autograd; whether two runs of the op are bitwise equal.
2. forward + backward of y, side by side in turn, three rounds (do_bench medians): the op called directly;
   transformers' grouped_mm experts forward for experts without a gate, written in torch ops (``torch_y``),
   compiled by backend="moe_fuse" (the pattern rewrites it into the op), by backend="inductor" (the peer)
   and run eagerly; then the forward alone (no grad) of the op and of the Inductor peer. % of the matmul
   peak measured in the same run (FLOPs 4 S H I forward, 3x that forward + backward; S = T k).
3. If this transformers has Nemotron-H experts on the experts interface (``has_gate``), its own
   ``NemotronHMoE`` block: backend="moe_fuse" against eager bf16 (errors) and against backend="inductor".
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moe_fuse.ops  # noqa: E402,F401  (registers torch.ops.moe_fuse)
from moe_fuse import reference  # noqa: E402

SHAPES = {"nano": (2688, 1856, 128, 6), "tiny": (64, 32, 8, 2)}  # H, I, E, k


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bench_ms(fn, rep_ms=200):
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=rep_ms)
    fn()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < rep_ms / 1e3:
        fn()
        n += 1
    return (time.perf_counter() - t0) * 1e3 / n


def case(shape, T, device, dtype, seed=0):
    H, I, E, k = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g, device=device) * scale  # noqa: E731
    x = r(T, H).to(dtype)
    top, ids = r(T, E).topk(k, dim=-1)
    w = top.softmax(-1).to(dtype)
    wu = r(E, I, H, scale=H**-0.5).to(dtype)  # up [E, I, H]: half the rows pass the relu
    wd = r(E, H, I, scale=I**-0.5).to(dtype)
    return x, ids, w, wu, wd


def op_y(x, ids, w, wu, wd):
    save_h = torch.is_grad_enabled()
    return torch.ops.moe_fuse.experts(x, ids, w, wu, wd, save_h, None, None, "relu2")[0]


def torch_y(x, ids, w, wu, wd):
    """transformers' grouped_mm experts forward for experts without a gate (Nemotron-H), in plain torch ops."""
    T, k = ids.shape
    E = wu.shape[0]
    eid, perm = torch.sort(ids.reshape(-1))
    xs = x[perm // k]
    hist = torch.histc(eid.int() if eid.is_cuda else eid.float(), bins=E, min=0, max=E - 1)
    offs = torch.cumsum(hist, dim=0, dtype=torch.int32)
    h = torch._grouped_mm(xs, wu.transpose(-2, -1), offs=offs)
    o = torch._grouped_mm(torch.square(F.relu(h)), wd.transpose(-2, -1), offs=offs)
    o = o * w.reshape(-1)[perm].unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.size(0), device=perm.device)
    return o[inv].view(T, k, -1).sum(dim=1).to(x.dtype)


def grads(fn, inputs, dy):
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    y = fn(*leaves)
    return (y.detach(), *torch.autograd.grad(y, [t for t in leaves if t.requires_grad], dy))


def check(inputs, dy):
    names = ["y", "dx", "d_weights", "dW_up", "dW_down"]
    got, again = grads(op_y, inputs, dy), grads(op_y, inputs, dy)
    print(f"  op: two runs bitwise equal: {all(torch.equal(a, b) for a, b in zip(got, again))}", flush=True)
    f32 = [t.float() if t.is_floating_point() else t for t in inputs]
    want = (reference.experts_forward(*f32, activation="relu2"),
            *reference.experts_backward(dy.float(), *f32, activation="relu2"))
    peer = grads(torch_y, inputs, dy)
    for i, name in enumerate(names):
        print(f"    {name:<10} moe_fuse vs fp32 {rel(got[i], want[i]):.1e}, transformers' math in "
              f"{inputs[0].dtype} (eager) vs fp32 {rel(peer[i], want[i]):.1e}", flush=True)


def timing(shape, T, device, dtype, peak, rounds=3):
    H, I, E, k = SHAPES[shape]
    inputs = case(shape, T, device, dtype, seed=2)
    dy = torch.randn(T, H, device=device).to(dtype)
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    torch._dynamo.reset()
    variants = {
        "moe_fuse op": op_y,
        "torch_y + backend=moe_fuse": torch.compile(torch_y, backend="moe_fuse", dynamic=False),
        "torch_y + backend=inductor": torch.compile(torch_y, backend="inductor", dynamic=False),
        "torch_y eager": torch_y,
    }

    def step(fn):
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(dy)

    for fn in variants.values():
        step(fn)  # compile, warm up
    import moe_fuse

    report = str(moe_fuse.explain(torch_y, *inputs)).splitlines()
    print("  " + " | ".join(line.strip() for line in report if "fused" in line or "left alone" in line)[:300])
    flop = 3 * 4 * T * k * H * I
    times = {n: [] for n in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(bench_ms(lambda fn=fn: step(fn)))
    base = min(times["torch_y + backend=inductor"])
    for name, ts in times.items():
        best = min(ts)
        print(f"  {shape} T={T} fwd+bwd {name:<28} {' / '.join(f'{t:.3f}' for t in ts)} ms, "
              f"{base / best:.2f}x of Inductor, {flop / best / 1e9 / peak:.0%} of the matmul peak", flush=True)
    with torch.no_grad():
        fwd = {"moe_fuse op": op_y, "torch_y + backend=inductor": torch.compile(torch_y, backend="inductor",
                                                                                dynamic=False)}
        for fn in fwd.values():
            fn(*inputs)
        fwd_ms = {n: min(bench_ms(lambda fn=fn: fn(*inputs)) for _ in range(rounds)) for n, fn in fwd.items()}
    print(f"  {shape} T={T} forward (no grad): moe_fuse op {fwd_ms['moe_fuse op']:.3f} ms, Inductor "
          f"{fwd_ms['torch_y + backend=inductor']:.3f} ms "
          f"({fwd_ms['torch_y + backend=inductor'] / fwd_ms['moe_fuse op']:.2f}x)", flush=True)


def hf_block(shape, T, device, dtype):
    try:
        from transformers import NemotronHConfig
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE
    except ImportError as e:
        print(f"  transformers has no Nemotron-H MoE block: {e}")
        return
    H, I, E, k = SHAPES[shape]
    try:
        cfg = NemotronHConfig(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=k,
                              moe_shared_expert_intermediate_size=2 * I, n_group=1, topk_group=1,
                              mlp_hidden_act="relu2")
        cfg._experts_implementation = "grouped_mm"
        with torch.device(device):
            block = NemotronHMoE(cfg, layer_idx=0).to(dtype)
    except Exception as e:  # a transformers whose Nemotron-H takes other arguments
        print(f"  NemotronHMoE could not be built here: {type(e).__name__}: {e}")
        return
    if not hasattr(block.experts, "has_gate"):
        print("  this transformers' NemotronHExperts is not on the experts interface (no has_gate): skipped")
        return
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    import moe_fuse
    from check_swiglu_limit_gpu import block_grads

    x = torch.randn(1, T, H, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    params = [x, *block.parameters()]
    print("  " + str(moe_fuse.explain(block, x)).splitlines()[0][:200])

    def run(fn):
        return block_grads(fn, x, dy, params)

    eager = run(block)
    names = ["y", "dx"] + [n for n, _ in block.named_parameters()]
    fns = {}
    for backend in ("moe_fuse", "inductor"):
        torch._dynamo.reset()
        fns[backend] = torch.compile(block, backend=backend, dynamic=False)
        got = run(fns[backend])
        worst = max((rel(a, b), n) for a, b, n in zip(got, eager, names))
        print(f"  NemotronHMoE {shape} T={T} backend={backend} vs eager {dtype}: worst rel. error "
              f"{worst[0]:.1e} ({worst[1]})", flush=True)
    for r in range(2):
        ms = {b: bench_ms(lambda fn=fn: run(fn)) for b, fn in fns.items()}
        print(f"  round {r}: fwd+bwd inductor {ms['inductor']:.3f} ms, moe_fuse {ms['moe_fuse']:.3f} ms "
              f"({ms['inductor'] / ms['moe_fuse']:.2f}x)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny bf16 shapes on the CPU: checks the script")
    args = ap.parse_args()
    from layer_bench import ensure_moe_fuse_backend, matmul_peak

    ensure_moe_fuse_backend()
    if args.cpu_smoke:
        shape, device, dtype, tokens, peak = "tiny", "cpu", torch.bfloat16, [48], 1.0
        print("CPU smoke run (the reference path; times and % of peak mean nothing)")
    else:
        shape, device, dtype = "nano", "cuda", torch.bfloat16
        tokens = [int(t) for t in args.tokens.split(",")]
        peak = matmul_peak(torch.device("cuda"), torch.bfloat16, False)["tflops"]  # TFLOP/s = GFLOP/ms
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; matmul peak {peak:.0f} TFLOP/s", flush=True)
    for i, T in enumerate(tokens):
        if i == 0:
            inputs = case(shape, T, device, dtype)
            check(inputs, torch.randn(T, inputs[0].shape[1], device=device).to(dtype))
        timing(shape, T, device, dtype, peak)
    hf_block(shape, tokens[-1], device, dtype)


if __name__ == "__main__":
    main()
