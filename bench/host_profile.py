#!/usr/bin/env python3
"""Host time vs GPU time of one compiled MoE layer, forward + backward, and where the host time goes.

    PYTHONPATH=. python3 bench/host_profile.py [--cases 30b:4096,235b:16384] [--top 30]

For transformers' block under Inductor and under moe_fuse (same block, same input):
- step ms: do_bench median of a whole step (what the layer benchmark reports);
- enqueue ms: host time per step with nothing waiting on the GPU (steps issued back to back, timed
  before the final synchronize); when it exceeds the GPU time, the host is the bottleneck;
- GPU busy ms: the sum of kernel times per step (torch.profiler);
- cProfile of the steps, by own time: which Python functions the host time is spent in (--top 0: none);
- moe_fuse with the weight gradients on one stream (kernels.backward.OVERLAP_WGRAD off), same compiled step.
"""

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_bench import SHAPES, build_block, ensure_moe_fuse_backend  # noqa: E402
from profile_layer import kernel_table  # noqa: E402


def enqueue_ms(step, n=30):
    """(host ms, wall ms) per step: n steps issued back to back, timed before and after the final synchronize."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3 / n, (t2 - t0) * 1e3 / n


def layer_step(fn, x, dy, params):
    """One forward + backward of the compiled block ``fn``, gradients of ``params`` reset first."""

    def step():
        for p in params:
            p.grad = None
        out = fn(x)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dy)

    return step


def profile_case(shape, tokens, backends, top):
    block = build_block(shape, "cuda", torch.bfloat16)
    x = torch.randn(1, tokens, SHAPES[shape][0], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    params = [x, *block.parameters()]
    times = {}
    for name in backends:
        step = layer_step(torch.compile(block, backend=name), x, dy, params)
        times[name] = ms = do_bench(step, warmup=20, rep=200, return_mode="median")
        enq, _ = enqueue_ms(step)
        print(f"== {name} {shape} T={tokens}: step {ms:.3f} ms, enqueue {enq:.3f} ms/step\n{kernel_table(step, top=8)}")
        if name == "moe_fuse":
            from moe_fuse.kernels import backward

            backward.OVERLAP_WGRAD = False
            one = do_bench(step, warmup=20, rep=200, return_mode="median")
            step()
            grads_one = [p.grad.clone() for p in params]
            backward.OVERLAP_WGRAD = True
            again = do_bench(step, warmup=20, rep=200, return_mode="median")
            step()
            same = all(torch.equal(a, p.grad) for a, p in zip(grads_one, params))
            print(f"   moe_fuse wgrad on one stream {one:.3f} ms; two streams again {again:.3f} ms; "
                  f"gradients bitwise equal: {same}")
        if top:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as tprof:
                for _ in range(10):
                    step()
                torch.cuda.synchronize()
            print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
            prof = cProfile.Profile()
            torch.cuda.synchronize()
            prof.enable()
            for _ in range(20):
                step()
            prof.disable()
            torch.cuda.synchronize()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
            print("\n".join(buf.getvalue().splitlines()[: top + 12]))
        torch._dynamo.reset()
    if "inductor" in times and "moe_fuse" in times:
        print(f"## {shape} T={tokens}: x_ind {times['inductor'] / times['moe_fuse']:.3f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="30b:4096", help="shape:tokens,...")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--backends", default="inductor,moe_fuse")
    args = parser.parse_args()
    ensure_moe_fuse_backend()
    for case in args.cases.split(","):
        shape, tokens = case.split(":")
        profile_case(shape, int(tokens), args.backends.split(","), args.top)


if __name__ == "__main__":
    main()
