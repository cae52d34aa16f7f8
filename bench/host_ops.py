#!/usr/bin/env python3
"""Host time of each moe_fuse op and launcher.

    PYTHONPATH=. python3 bench/host_ops.py [--shape 30b] [--tokens 4096]

Each line: host microseconds per call issued back to back (valid only where the GPU keeps up: once
the launch queue fills, the host waits for the GPU), host microseconds per call with the GPU idle
before each call (synchronize, then time the call alone: the host cost whatever the GPU time), and
the GPU milliseconds per call (CUDA events). Where the host cost of a layer exceeds its GPU time, the
host sets the pace. "direct" cases call an op's Python implementation without the custom-op wrapper.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moe_fuse.ops  # noqa: E402,F401  (registers torch.ops.moe_fuse)
from moe_fuse import kernels  # noqa: E402
from moe_fuse.kernels import backward, grouped_gemm  # noqa: E402
from moe_fuse.kernels.combine import combine  # noqa: E402

SHAPES = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8), "tiny": (64, 32, 8, 2)}


@triton.jit
def _noop_kernel(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(fn, reps=200):
    """(host us per call, GPU ms per call): ``reps`` calls back to back, then one synchronize.

    At small sizes the GPU finishes each call sooner than the host issues the next, so the loop
    runs at the host's pace: the time per call is the host cost of a call.
    """
    for _ in range(5):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) * 1e6 / reps
    sync()
    idle = []
    for _ in range(min(reps, 50)):
        sync()
        t0 = time.perf_counter()
        fn()
        idle.append(time.perf_counter() - t0)
    idle = sorted(idle)[len(idle) // 2] * 1e6
    sync()
    if not torch.cuda.is_available():  # CPU smoke run (TRITON_INTERPRET=1): host time only
        return host, idle, float("nan")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        fn()
    end.record()
    sync()
    return host, idle, start.elapsed_time(end) / 10


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="30b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--cprofile", default="", help="name of a case to run under cProfile (by cumulative time)")
    args = parser.parse_args()
    H, I, E, k = SHAPES[args.shape]
    T = args.tokens
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    bf = torch.bfloat16
    x = torch.randn(T, H, device=dev, dtype=bf)
    wr = torch.randn(E, H, device=dev, dtype=bf) * 0.02
    wgu = torch.randn(E, 2 * I, H, device=dev, dtype=bf) * 0.02
    wd = torch.randn(E, H, I, device=dev, dtype=bf) * 0.02
    logits, weights, ids = torch.ops.moe_fuse.router(x, wr, k, True, bf)
    y, h, xs, kept_routing, aw = torch.ops.moe_fuse.experts(x, ids, weights, wgu, wd, True)
    dy = torch.randn_like(y)
    routing = kernels.route(ids, E)
    a, _ = grouped_gemm.gate_up(x, routing, wgu, k)
    dwts = torch.randn(T, k, device=dev, dtype=torch.float32)
    buf = torch.empty(1024, device=dev)
    ops = torch.ops.moe_fuse
    from moe_fuse import reference

    ref_router_bwd = lambda: reference.router_backward(torch.zeros_like(logits), dwts, x, wr, logits, ids, True)  # noqa: E731
    cases = {
        "triton no-op kernel (1 launch)": lambda: _noop_kernel[(1,)](buf, 1024, BLOCK=1024),
        "torch.empty": lambda: torch.empty(T, H, device=dev, dtype=bf),
        "op router": lambda: ops.router(x, wr, k, True, bf),
        "op experts (save_h)": lambda: ops.experts(x, ids, weights, wgu, wd, True),
        "op experts_backward": lambda: ops.experts_backward(dy, x, ids, weights, wgu, wd, h, xs, kept_routing, aw),
        "op router_backward": lambda: ops.router_backward(torch.zeros_like(logits), dwts, x, wr, logits, ids, True),
        "op router_backward, d_logits None": lambda: ops.router_backward(None, dwts, x, wr, logits, ids, True),
        "direct router_backward, d_logits None": lambda: moe_fuse.ops.router_backward(
            None, dwts, x, wr, logits, ids, True),
        "direct experts (save_h)": lambda: moe_fuse.ops.experts(x, ids, weights, wgu, wd, True),
        "direct experts_backward": lambda: moe_fuse.ops.experts_backward(
            dy, x, ids, weights, wgu, wd, h, xs, kept_routing, aw),
        "reference.router_backward": ref_router_bwd,
        "kernels.experts_forward (save_h)": lambda: kernels.experts_forward(x, ids, weights, wgu, wd, save_h=True),
        "kernels.experts_backward": lambda: kernels.experts_backward(dy, x, ids, weights, wgu, wd, h),
        "route (3 launches)": lambda: kernels.route(ids, E),
        "gate_up": lambda: grouped_gemm.gate_up(x, routing, wgu, k, save_h=True),
        "down": lambda: grouped_gemm.down(a, routing, weights, wd, bf),
        "combine": lambda: combine(torch.empty(T * k, H, device=dev, dtype=bf), ids, E, bf),
        "experts_by_rows (sort)": lambda: backward.experts_by_rows(routing),
        "dgrad_saved (2 launches)": lambda: backward.dgrad_saved(dy, routing, weights.reshape(-1), h, wd, k, bf),
        "wgrad dW_down": lambda: backward.wgrad(dy, True, a, False, routing, E, k, bf),
        "interpreting() x10": lambda: [kernels._jit.interpreting() for _ in range(10)],
    }
    if dev == "cuda":  # the grouped_mm path (training on sm90+ bf16) and its parts
        from moe_fuse.kernels import grouped_mm_path as gp
        from moe_fuse.kernels.permute import combine_sorted, expand_rows

        @torch.library.custom_op("moe_fuse_bench::noop", mutates_args=())
        def noop(t: torch.Tensor) -> torch.Tensor:
            return t.new_empty(0)

        noop.register_fake(lambda t: t.new_empty(0))
        ends = routing.offsets[1:]
        pos = routing.pos.view(T, k)
        rows = expand_rows(x, pos)
        hh = torch._grouped_mm(rows, wgu.transpose(1, 2), offs=ends)
        g = torch._grouped_mm(rows, wd, offs=ends)
        rw = weights.reshape(-1).contiguous()
        path_out = gp.experts_forward(x, ids, weights, wgu, wd, save_h=True, keep_rows=True)
        cases.update({
            "custom op, empty body (dispatch)": lambda: ops_bench.noop(x),
            "F.linear (router logits)": lambda: torch.nn.functional.linear(x, wr),
            "softmax_topk": lambda: kernels.softmax_topk(logits, k, True, bf),
            "expand_rows": lambda: expand_rows(x, pos),
            "torch._grouped_mm (1 call)": lambda: torch._grouped_mm(rows, wgu.transpose(1, 2), offs=ends),
            "swiglu": lambda: gp.swiglu(hh, routing, rw),
            "combine_sorted": lambda: combine_sorted(rows, pos, weights, bf, ids=ids, num_experts=E),
            "dswiglu": lambda: backward.dswiglu(g, hh, rw, routing, bf),
            "routing_from_buffer": lambda: kernels.routing_from_buffer(kept_routing, T * k, E),
            "grouped_mm_path.experts_forward": lambda: gp.experts_forward(x, ids, weights, wgu, wd, save_h=True,
                                                                          keep_rows=True),
            "grouped_mm_path.experts_backward": lambda: gp.experts_backward(
                dy, x, ids, weights, wgu, wd, path_out[1], routing=path_out[2], xs=path_out[3], aw=path_out[4]),
        })
        ops_bench = torch.ops.moe_fuse_bench
    if args.cprofile:
        import cProfile
        import io
        import pstats

        fn = cases[args.cprofile]
        host_us(fn, 20)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.reps):
            fn()
        prof.disable()
        sync()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
        print(text.getvalue())
    print(f"{args.shape} T={T}: host us per call (back to back) | host us per call (GPU idle first) | GPU ms")
    for name, fn in cases.items():
        us, idle, ms = host_us(fn, args.reps)
        print(f"  {name:<38} {us:9.1f} us | {idle:9.1f} us | {ms:8.3f} ms")


if __name__ == "__main__":
    main()
