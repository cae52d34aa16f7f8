"""Where the time of one compiled MoE layer goes (GPU): per-kernel profile and a few what-ifs.

    PYTHONPATH=. python3 bench/profile_layer.py [--shape 30b] [--tokens 16384] [--backward]

--backward profiles forward + backward (parameters and input require grad; no what-ifs).

Prints, for transformers' block under Inductor and under moe_fuse, the CUDA
kernels that take the time (torch.profiler, averaged over iterations), and the
layer time with alternative kernel settings. Same block, same input.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_bench import SHAPES, build_block, ensure_moe_fuse_backend  # noqa: E402


def kernel_table(fn, iters=10, top=12):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / iters / 1e3
    lines = [f"    GPU busy {total:.3f} ms/iter"]
    for e in events[:top]:
        lines.append(f"    {e.device_time_total / iters / 1e3:8.3f} ms  x{e.count // iters:<3} {e.key[:90]}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="30b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--backward", action="store_true", help="forward + backward, no what-ifs")
    args = parser.parse_args()
    ensure_moe_fuse_backend()
    block = build_block(args.shape, "cuda", torch.bfloat16)
    x = torch.randn(1, args.tokens, SHAPES[args.shape][0], device="cuda", dtype=torch.bfloat16)
    if args.backward:
        x.requires_grad_()
        dy = torch.randn_like(x)
        for name in ("inductor", "moe_fuse"):
            fn = torch.compile(block, backend=name)

            def step(fn=fn):
                out = fn(x)
                out = out[0] if isinstance(out, tuple) else out
                out.backward(dy)

            ms = do_bench(step, warmup=20, rep=200, return_mode="median", grad_to_none=[x, *block.parameters()])
            print(f"== {name} fwd+bwd: {ms:.3f} ms\n{kernel_table(step, top=20)}")
        return
    with torch.no_grad():
        variants = {name: torch.compile(block, backend=name) for name in ("inductor", "moe_fuse")}
        times = {}
        for name, fn in variants.items():
            times[name] = do_bench(lambda: fn(x), warmup=50, rep=300, return_mode="median")
            print(f"== {name}: {times[name]:.3f} ms\n{kernel_table(lambda: fn(x))}")

        from moe_fuse.kernels import grouped_gemm

        default = grouped_gemm.default_config

        def what_if(label, change):
            grouped_gemm.default_config = lambda kind, *a: change(kind, default(kind, *a))
            ms = do_bench(lambda: variants["moe_fuse"](x), warmup=50, rep=300, return_mode="median")
            grouped_gemm.default_config = default
            print(f"  what-if {label:<32} {ms:.3f} ms  x_ind {times['inductor'] / ms:.3f}")

        print(f"  what-if {'(defaults again)':<32} "
              f"{do_bench(lambda: variants['moe_fuse'](x), warmup=50, rep=300, return_mode='median'):.3f} ms")
        for g in (4, 16):
            what_if(f"down group_m={g}", lambda kind, c, g=g: dataclasses.replace(c, group_m=g) if kind == "down" else c)
            what_if(f"gate_up group_m={g}", lambda kind, c, g=g: dataclasses.replace(c, group_m=g) if kind == "gate_up" else c)
        what_if("down 4 stages", lambda kind, c: dataclasses.replace(c, num_stages=4) if kind == "down" else c)
        what_if("gate_up 4 stages", lambda kind, c: dataclasses.replace(c, num_stages=4) if kind == "gate_up" else c)


if __name__ == "__main__":
    main()
