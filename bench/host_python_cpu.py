#!/usr/bin/env python3
"""The Python part of the host cost of moe_fuse's hot ops, measured on the CPU (no GPU needed).

    PYTHONPATH=. python3 bench/host_python_cpu.py [--reps 2000] [--cprofile NAME]

On the H200 hosts a training step of the 30B layer at T=4096 is host-bound: its host time is the
launches (driver and Triton's launcher, fixed) plus our own Python around them (argument checks,
views, allocations, dispatch). This tool takes the fixed part out so the second can be worked on
without device time: every Triton launch becomes a no-op, ``torch._grouped_mm`` returns an empty
tensor, and the CPU tensors take the CUDA code path. The numbers are this machine's; compare them
with each other, then confirm on the GPU with bench/host_ops.py.
"""

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moe_fuse.ops  # noqa: E402  (registers torch.ops.moe_fuse)
from moe_fuse import kernels  # noqa: E402
from moe_fuse.kernels import _jit  # noqa: E402

SHAPES = {"30b": (2048, 768, 128, 8)}


def _stub_launches():
    """Launches do nothing; CPU tensors take the kernels' path (as on CUDA)."""
    from moe_fuse.kernels import backward, grouped_mm_path, permute, router, routing  # noqa: F401

    _jit.lazy_jit.__getitem__ = lambda self, grid: (lambda *a, **k: None)
    def grouped_mm(a, b, offs=None, **k):  # torch's output shapes: [groups, M, N] for 2-D x 2-D (ragged K)
        if a.dim() == 2 and b.dim() == 2:
            return a.new_empty((offs.numel(), a.shape[0], b.shape[1]))
        return a.new_empty((*a.shape[:-1], b.shape[-1]))

    torch._grouped_mm = grouped_mm
    permute._use_kernels = lambda t: True
    from moe_fuse.kernels import forward

    forward.interpreter_usable = lambda: True  # supports(): the CPU counts as a kernel device
    torch.cuda.current_device = lambda: 0  # applies(): the capability of "device 0"
    grouped_mm_path._CAPABILITY[0] = 9
    torch.Tensor.is_cuda = property(lambda self: True)  # the ops take their CUDA branch


def per_call_us(fn, reps, rounds=5):
    """The best of ``rounds`` means over ``reps`` calls: the least disturbed by other work on the machine."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) * 1e6 / reps)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256, help="small: CPU allocations stay cheap")
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--cprofile", default="", help="a case name to run under cProfile")
    ap.add_argument("--sort", default="tottime", help="cProfile order: tottime or cumulative")
    args = ap.parse_args()
    H, I, E, k = SHAPES["30b"]
    T = args.tokens
    bf = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, dtype=bf, generator=g)
    wr = torch.randn(E, H, dtype=bf, generator=g) * 0.02
    wgu = torch.randn(E, 2 * I, H, dtype=bf, generator=g) * 0.02
    wd = torch.randn(E, H, I, dtype=bf, generator=g) * 0.02
    logits = x @ wr.t()
    ids = torch.randperm(E, generator=g)[:k].repeat(T, 1)
    weights = torch.rand(T, k, generator=g).to(bf)
    dwts = torch.randn(T, k)
    _stub_launches()
    ops = torch.ops.moe_fuse
    _, h, xs, routing, aw = ops.experts(x, ids, weights, wgu, wd, True)
    dy = torch.randn(T, H, dtype=bf, generator=g)
    dh = torch.randn(T * k, 2 * I, dtype=bf, generator=g)
    xr, lr, ir, dr = x[:16], logits[:16], ids[:16], dwts[:16]  # the routers' matmuls are real here: keep them tiny
    cases = {
        "torch.empty": lambda: torch.empty(T, H, dtype=bf),
        "op router (T=16)": lambda: ops.router(xr, wr, k, True, bf),
        "op experts (save_h)": lambda: ops.experts(x, ids, weights, wgu, wd, True),
        "op experts_backward": lambda: ops.experts_backward(dy, x, ids, weights, wgu, wd, h, xs, routing, aw),
        # the same backward as three ops (ops.SPLIT_BACKWARD, the compiled training path): their sum against the one op
        "op experts_backward_down": lambda: ops.experts_backward_down(dy, x, ids, weights, wgu, wd, h, routing, aw),
        "op experts_backward_gate_up": lambda: ops.experts_backward_gate_up(dh, x, ids, wgu, wd, routing),
        "op experts_backward_weight_gate_up": lambda: ops.experts_backward_weight_gate_up(dh, x, ids, wgu, wd, xs,
                                                                                          routing),
        "op router_backward (T=16)": lambda: ops.router_backward(None, dr, xr, wr, lr, ir, True),
        "route": lambda: kernels.route(ids, E),
    }
    if args.cprofile:
        for _ in range(20):  # first calls import and compile: not what a step pays
            cases[args.cprofile]()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            cases[args.cprofile]()
        pr.disable()
        pstats.Stats(pr).sort_stats(args.sort).print_stats(30)
        return
    print(f"30b T={T}: Python host us per call, launches stubbed (torch {torch.__version__})")
    for name, fn in cases.items():
        print(f"  {name:38s} {per_call_us(fn, args.reps):8.1f} us")


if __name__ == "__main__":
    main()
