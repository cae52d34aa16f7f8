#!/usr/bin/env python3
"""The direct Triton launch of kernels/_jit.py (DIRECT_LAUNCH) on the GPU: same bits, less host time.

    PYTHONPATH=. python3 bench/check_direct_launch_gpu.py [--shape 30b] [--tokens 4096,16384] [--rounds 3]

1. Host microseconds per call of a one-block kernel, of each launcher of the grouped_mm path and of the
   four ops, through triton's ``JITFunction.run`` (DIRECT_LAUNCH off) and directly (on).
2. One compiled layer step (transformers' block, forward + backward) per T, run under each setting
   below; outputs and every gradient must be bitwise those of the first setting.
3. Those settings and Inductor timed in turn, ``--rounds`` times (do_bench median of the step; host ms
   per step issued back to back): where the host sets the pace, the step follows its host time.

Settings: ``triton_run`` (DIRECT_LAUNCH off, the product before it), ``direct`` (on), ``direct_ragged`` (on,
and ragged_gemm at every size: grouped_mm_path.RAGGED_MIN_ROWS = 0, the other side of the 64K-row gate).
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from host_profile import enqueue_ms, layer_step  # noqa: E402
from layer_bench import SHAPES, build_block, ensure_moe_fuse_backend  # noqa: E402
from moe_fuse.kernels import _jit, grouped_mm_path  # noqa: E402
from moe_fuse.kernels._jit import lazy_jit  # noqa: E402

SETTINGS = {"triton_run": (False, 65536), "direct": (True, 65536), "direct_ragged": (True, 0)}


@lazy_jit
def _one_block_kernel(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


def apply(setting):
    _jit.DIRECT_LAUNCH, grouped_mm_path.RAGGED_MIN_ROWS = SETTINGS[setting]


def host_us(fn, reps=300):
    """Host microseconds per call with the GPU idle before each call (the host cost whatever the GPU time)."""
    for _ in range(5):
        fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    out.sort()
    return out[len(out) // 2] * 1e6


def launch_costs(shape, T):
    from moe_fuse.kernels.permute import combine_sorted, expand_rows
    from moe_fuse.kernels.ragged_gemm import ragged_gemm, tile_map
    from moe_fuse.kernels.backward import dswiglu
    from moe_fuse.kernels.router import softmax_topk
    from moe_fuse.kernels.routing import route

    import moe_fuse.ops  # noqa: F401  (registers torch.ops.moe_fuse)

    H, I, E, k = SHAPES[shape]
    dev = "cuda"
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, device=dev), -1).to(torch.bfloat16)
    wgu = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
    small = torch.zeros(64, device=dev)
    routing = route(ids, E)
    xs = expand_rows(x, routing.pos.view(T, k))
    tiles = tile_map(routing.offsets, T * k)
    h = ragged_gemm(xs, wgu, tiles, b_kmajor=True)
    wd = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02
    wr = torch.randn(E, H, device=dev, dtype=torch.bfloat16) * 0.02
    logits = x @ wr.t()
    dw = torch.randn(T, k, device=dev)
    ops = torch.ops.moe_fuse
    saved = ops.experts(x, ids, w, wgu, wd, True)[1:]
    cases = {
        "one-block kernel": lambda: _one_block_kernel[(1,)](small, 64, BLOCK=64),
        "route (3 launches)": lambda: route(ids, E),
        "expand_rows": lambda: expand_rows(x, routing.pos.view(T, k)),
        "tile_map": lambda: tile_map(routing.offsets, T * k),
        "ragged_gemm gate_up": lambda: ragged_gemm(xs, wgu, tiles, b_kmajor=True),
        "swiglu": lambda: grouped_mm_path.swiglu(h, routing, w.reshape(-1)),
        "combine_sorted": lambda: combine_sorted(xs, routing.pos.view(T, k), None, x.dtype, ids=ids, num_experts=E),
        "dswiglu": lambda: dswiglu(h[:, :I].contiguous(), h, w.reshape(-1), routing, w.dtype, write_aw=False),
        "softmax_topk": lambda: softmax_topk(logits, k, True, torch.bfloat16),
        "op router": lambda: ops.router(x, wr, k, True, torch.bfloat16),
        "op experts (save_h)": lambda: ops.experts(x, ids, w, wgu, wd, True),
        "op experts_backward": lambda: ops.experts_backward(x, x, ids, w, wgu, wd, *saved),
        "op router_backward": lambda: ops.router_backward(None, dw, x, wr, logits, ids, True),
        "torch._grouped_mm (reference)": lambda: torch._grouped_mm(xs, wgu.transpose(1, 2), offs=routing.offsets[1:]),
    }
    print(f"host us per call, GPU idle first ({shape} T={T}): triton_run | direct")
    for name, fn in cases.items():
        row = []
        for direct in (False, True):
            _jit.DIRECT_LAUNCH = direct
            row.append(host_us(fn))
        print(f"  {name:<32} {row[0]:7.1f} | {row[1]:7.1f} us")
    _jit.DIRECT_LAUNCH = True


def case(shape, T, rounds):
    H = SHAPES[shape][0]
    block = build_block(shape, "cuda", torch.bfloat16)
    x = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    params = [x, *block.parameters()]
    steps = {"inductor": layer_step(torch.compile(block, backend="inductor"), x, dy, params)}
    fused = layer_step(torch.compile(block, backend="moe_fuse"), x, dy, params)
    ref = None
    for setting in SETTINGS:
        apply(setting)
        for _ in range(2):
            fused()  # the first call of a setting compiles / fills its launch keys
        fused()
        got = [p.grad.clone() for p in params]
        if ref is None:
            ref = got
        worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref, got))
        same = all(torch.equal(a, b) for a, b in zip(ref, got))
        print(f"{shape} T={T} {setting:<12} gradients bitwise those of triton_run: {same} (max abs diff {worst:.3g})")
        if not same:
            raise SystemExit(f"{setting} changed the results")
        steps[setting] = fused
    print(f"{shape} T={T}: step ms (do_bench median) / host ms per step issued back to back, in turn")
    for r in range(rounds):
        line = []
        for name, step in steps.items():
            if name in SETTINGS:
                apply(name)
            ms = do_bench(step, warmup=25, rep=200, return_mode="median")
            host, _ = enqueue_ms(step, n=50)
            line.append(f"{name} {ms:.3f} / {host:.3f}")
        print(f"  round {r}: " + ", ".join(line))
    apply("direct")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="30b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ensure_moe_fuse_backend()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    tokens = [int(t) for t in args.tokens.split(",")]
    launch_costs(args.shape, tokens[0])
    for T in tokens:
        case(args.shape, T, args.rounds)


if __name__ == "__main__":
    main()
