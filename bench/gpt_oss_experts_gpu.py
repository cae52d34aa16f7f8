#!/usr/bin/env python3
"""GPT-OSS experts on the GPU: biases on both projections, gate / up rows interleaved, the clamped alpha gate
(limit 7, alpha 1.702), weights stored [E, in, out].

    PYTHONPATH=. python3 bench/gpt_oss_experts_gpu.py [--shapes 20b,120b] [--tokens 4096,16384]

Per shape and token count, bf16, routing weights of a softmax over top-k logits, fwd + bwd of y:
1. moe_fuse (``ops.experts_with_biases``: the op on grouped_mm_path and the down-bias GEMM) against fp32 math of
   the same definition (``reference``, T=4096 only) beside the bias-less, concatenated op's own error on the
   same draws; two runs bitwise equal or not.
2. Side by side, in turn, three rounds (do_bench medians): moe_fuse; the same math as transformers' grouped_mm
   experts forward for GPT-OSS, written in torch ops and compiled by Inductor (the peer); and moe_fuse's op
   without biases on concatenated rows (what the two features cost). % of the matmul peak measured here.
3. If this transformers has GPT-OSS experts on the experts interface (``has_bias``), transformers' own block
   compiled by backend="moe_fuse" against backend="inductor" (what the pattern does with it).
"""

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from layer_bench import ensure_moe_fuse_backend, matmul_peak  # noqa: E402
from moe_fuse import ops, reference  # noqa: E402

SHAPES = {"20b": (2880, 2880, 32, 4), "120b": (2880, 2880, 128, 4)}  # H, I, E, k
LIMIT, ALPHA = 7.0, 1.702


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def case(shape, T, seed=0):
    H, I, E, k = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device="cuda") * scale)  # noqa: E731
    x = r(T, H).bfloat16()
    logits = r(T, E)
    top, ids = logits.topk(k, dim=-1)
    w = top.softmax(-1).bfloat16()
    # stored [E, in, out] as GPT-OSS keeps them; the op takes the transposed views
    wgu = r(E, H, 2 * I, scale=3 * H**-0.5).bfloat16()  # |h| reaches the clamps at 7
    wd = r(E, I, H, scale=I**-0.5).bfloat16()
    bgu, bd = r(E, 2 * I, scale=0.5).bfloat16(), r(E, H, scale=0.5).bfloat16()
    return x, ids, w, wgu, wd, bgu, bd


def moe_fuse_y(x, ids, w, wgu, wd, bgu, bd):
    return ops.experts_with_biases(x, ids, w, wgu.transpose(1, 2), wd.transpose(1, 2), bgu, bd, True, LIMIT, ALPHA,
                                   interleaved=True)


def plain_y(x, ids, w, wgu, wd, bgu, bd):
    return torch.ops.moe_fuse.experts(x, ids, w, wgu.transpose(1, 2), wd.transpose(1, 2), True, LIMIT, ALPHA)[0]


def torch_y(x, ids, w, wgu, wd, bgu, bd):
    """transformers' grouped_mm experts forward for GPT-OSS, in plain torch ops (our spelling)."""
    T, k = ids.shape
    E = wgu.shape[0]
    eid, perm = ids.reshape(-1).sort()
    xs = x[perm // k]
    offs = torch.cumsum(torch.histc(eid.int() if eid.is_cuda else eid.float(), bins=E, min=0, max=E - 1), 0,
                        dtype=torch.int32)
    h = torch._grouped_mm(xs, wgu, offs=offs) + bgu[eid]
    gate, up = h[:, ::2].clamp(max=LIMIT), h[:, 1::2].clamp(min=-LIMIT, max=LIMIT)
    a = (up + 1) * (gate * torch.sigmoid(gate * ALPHA))
    o = (torch._grouped_mm(a, wd, offs=offs) + bd[eid]) * w.reshape(-1)[perm, None]
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return o[inv].view(T, k, -1).sum(1).to(x.dtype)


def f32_y(x, ids, w, wgu, wd, bgu, bd):
    f = [t.float() for t in (x, w, wgu, wd, bgu, bd)]
    x, w, wgu, wd, bgu, bd = f
    y = reference.experts_forward(x, ids, w, wgu.transpose(1, 2), wd.transpose(1, 2), swiglu_limit=LIMIT,
                                  glu_alpha=ALPHA, gate_up_bias=bgu, interleaved=True)
    return y + reference.down_bias_term(ids, w, bd, bd.shape[0])


def grads(fn, inputs, dy):
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    y = fn(*leaves)
    floats = [t for t in leaves if t.requires_grad]
    return (y.detach(), *torch.autograd.grad(y, floats, dy))


def check(shape, T):
    inputs = case(shape, T)
    dy = torch.randn(T, inputs[0].shape[1], device="cuda", generator=torch.Generator("cuda").manual_seed(1)).bfloat16()
    names = ["y", "dx", "d_weights", "dW_gate_up", "dW_down", "d_gate_up_bias", "d_down_bias"]
    got, again = grads(moe_fuse_y, inputs, dy), grads(moe_fuse_y, inputs, dy)
    print(f"  {shape} T={T}: two runs bitwise equal: {all(torch.equal(a, b) for a, b in zip(got, again))}")
    if T > 4096:
        return
    want = grads(f32_y, inputs, dy.float())
    peer = grads(torch_y, inputs, dy)
    for i, name in enumerate(names):
        print(f"    {name:<15} moe_fuse vs fp32 {rel(got[i], want[i]):.1e}, torch bf16 (eager) vs fp32 "
              f"{rel(peer[i], want[i]):.1e}", flush=True)


def timing(shape, T, peak, rounds=3):
    H, I, E, k = SHAPES[shape]
    inputs = case(shape, T, seed=2)
    dy = torch.randn(T, H, device="cuda").bfloat16()
    flop = 3 * 6 * T * k * H * I  # fwd 2 * S * H * 2I + 2 * S * I * H; bwd twice that
    compiled = torch.compile(torch_y, backend="inductor", dynamic=False)
    variants = {"moe_fuse": moe_fuse_y, "torch + Inductor": compiled, "moe_fuse, no biases, concat": plain_y}
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]

    def step(fn):
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(dy)

    for fn in variants.values():
        step(fn)  # compile / warm up
    times = {n: [] for n in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(do_bench(lambda fn=fn: step(fn), warmup=25, rep=200))
    from moe_fuse.kernels import backward, routing

    r = routing.route(inputs[1], E)
    dh = torch.randn(T * k, 2 * I, device="cuda").bfloat16()
    sums_ms = do_bench(lambda: backward.expert_sums(dh, r, torch.bfloat16), warmup=25, rep=100)
    print(f"  {shape} T={T} the gate_up bias gradient (expert_sums of d_h [{T * k}, {2 * I}]) alone: {sums_ms:.3f} ms, "
          f"{dh.numel() * 2 / sums_ms / 1e9:.2f} TB/s", flush=True)
    base = min(times["torch + Inductor"])
    for name, ts in times.items():
        best = min(ts)
        print(f"  {shape} T={T} {name:<28} fwd+bwd {' / '.join(f'{t:.3f}' for t in ts)} ms, "
              f"{base / best:.2f}x of Inductor, {flop / best / 1e9 / peak:.0%} of the matmul peak", flush=True)


def hf_block(shape, T):
    try:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    except ImportError as e:
        print(f"  transformers has no GPT-OSS: {e}")
        return
    H, I, E, k = SHAPES[shape]
    cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=k)
    cfg._experts_implementation = "grouped_mm"
    with torch.device("cuda"):
        block = GptOssMLP(cfg).bfloat16()
    if not getattr(block.experts, "has_bias", False):
        print(f"  transformers' GptOssExperts here is not on the experts interface (no has_bias): skipped")
        return
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    ensure_moe_fuse_backend()
    import moe_fuse

    x = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    print("  " + str(moe_fuse.explain(block, x)).splitlines()[0][:200])
    torch._dynamo.reset()
    for backend in ("moe_fuse", "inductor"):
        fn = torch.compile(block, backend=backend, dynamic=False)
        step = lambda: fn(x)[0].sum().backward()  # noqa: E731
        step()
        print(f"  HF GptOssMLP {shape} T={T} backend={backend}: fwd+bwd {do_bench(step, warmup=25, rep=200):.3f} ms",
              flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="20b,120b")
    ap.add_argument("--tokens", default="4096,16384")
    args = ap.parse_args()
    shapes, tokens = args.shapes.split(","), [int(t) for t in args.tokens.split(",")]
    peak = matmul_peak(torch.device("cuda"), torch.bfloat16, False)["tflops"]  # TFLOP/s = GFLOP/ms
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; matmul peak {peak:.0f} TFLOP/s", flush=True)
    for shape in shapes:
        for T in tokens:
            check(shape, T)
            timing(shape, T, peak)
    hf_block(shapes[0], tokens[-1])


if __name__ == "__main__":
    main()
