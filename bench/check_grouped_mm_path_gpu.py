#!/usr/bin/env python3
"""Check and time kernels/grouped_mm_path.py against the all-Triton kernels, on a GPU, in one run.

    cd <repo> && PYTHONPATH=. python3 bench/check_grouped_mm_path_gpu.py [--cases 30b:16384,30b:4096,235b:16384]

Per case (bf16): uneven Zipf-like routing with empty experts, and balanced routing; on the first case also
expert-parallel sentinels and a stride-0 dy. For both implementations: y and the four gradients against
reference.experts_forward / experts_backward in fp32 on fp32 copies (relative norm), buffers poisoned with
NaN, a second run bitwise equal. Then the times (do_bench median, balanced routing) of the forward keeping h
and the backward reading it. FLOPs: forward 6*S*H*I, backward 12*S*H*I; % of an 8192^3 bf16 matmul.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from check_kernels_gpu import bench_ms, make_tokens, make_weights, matmul_peak, poisoned_buffers, rel_err  # noqa: E402
from moe_fuse import reference  # noqa: E402
from moe_fuse.kernels import backward, forward, grouped_mm_path  # noqa: E402

LAYERS = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8)}  # H, I, E, k
def _gmm_forward(*args, save_h=False):
    """The training forward as the op runs it: h, the routing and the sorted rows kept."""
    return grouped_mm_path.experts_forward(*args, save_h=save_h, keep_rows=save_h)


def _gmm_backward(dy, *args):
    *inputs, kept = args
    h, routing, xs, aw = kept if isinstance(kept, tuple) else (kept, None, None, None)
    return grouped_mm_path.experts_backward(dy, *inputs, h, routing=routing, xs=xs, aw=aw)


def _saved(path, out):
    """What a forward's output hands its backward: (h, routing, xs, aw) on the grouped_mm path, h on Triton's."""
    return tuple(out[1:5]) if path == "grouped_mm" else out[1]


PATHS = {
    "grouped_mm": (_gmm_forward, _gmm_backward),
    "triton": (forward.experts_forward, backward.experts_backward),
}
NAMES = ("y", "dx", "d_weights", "dW_gate_up", "dW_down")


def check(label, x, ids, weights, wgu, wd, dy):
    f32 = [t.float() for t in (x, weights, wgu, wd)]
    want = [reference.experts_forward(f32[0], ids, *f32[1:])]
    want += list(reference.experts_backward(dy.float(), f32[0], ids, *f32[1:]))
    for name, (fwd, bwd) in PATHS.items():
        with poisoned_buffers():
            out = fwd(x, ids, weights, wgu, wd, save_h=True)
            got = [out[0], *bwd(dy, x, ids, weights, wgu, wd, _saved(name, out))]
        out = fwd(x, ids, weights, wgu, wd, save_h=True)
        again = [out[0], *bwd(dy, x, ids, weights, wgu, wd, _saved(name, out))]
        errs = " ".join(f"{n} {rel_err(g, w):.1e}" for n, g, w in zip(NAMES, got, want))
        finite = all(bool(torch.isfinite(g).all()) for g in got)
        repeat = all(torch.equal(a, b) for a, b in zip(got, again))
        print(f"  check {label:24s} {name:10s} {errs}  finite {finite}  repeatable {repeat}", flush=True)


def check_op(dev):
    """The experts op on CUDA bf16 keeps h, xs, the routing and aw; its fake implementation agrees (opcheck)."""
    from torch.library import opcheck

    import moe_fuse.ops  # noqa: F401  (registers the ops)

    gen = torch.Generator(device=dev).manual_seed(0)
    T, (H, I, E, k) = 256, LAYERS["30b"]
    wgu, wd = make_weights(H, I, E, torch.bfloat16, dev, gen)
    x, ids, weights = make_tokens(T, H, E, k, "uneven", torch.bfloat16, dev, gen)
    req = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    for save_h in (False, True):
        y, h, xs, routing, aw = torch.ops.moe_fuse.experts(x, ids, weights, wgu, wd, save_h)
        print(f"  op experts save_h={save_h}: h {tuple(h.shape)} xs {tuple(xs.shape)} routing {tuple(routing.shape)}"
              f" aw {tuple(aw.shape)}")
        opcheck(torch.ops.moe_fuse.experts.default, (req(x), ids, req(weights), req(wgu), req(wd), save_h))
    dy = torch.randn_like(x)
    opcheck(torch.ops.moe_fuse.experts_backward.default, (dy, x, ids, weights, wgu, wd, h, xs, routing, aw))
    print("  opcheck experts / experts_backward on CUDA: passed", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="30b:16384,30b:4096,235b:16384")
    args = ap.parse_args()
    dev = torch.device("cuda")
    peak = matmul_peak(dev)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, matmul peak {peak:.1f} TFLOP/s")
    check_op(dev)
    for n, case in enumerate(args.cases.split(",")):
        layer, T = case.split(":")
        T = int(T)
        H, I, E, k = LAYERS[layer]
        gen = torch.Generator(device=dev).manual_seed(T + n)
        wgu, wd = make_weights(H, I, E, torch.bfloat16, dev, gen)
        print(f"\n=== {layer} T={T} (H={H} I={I} E={E} k={k})")
        dy = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
        for routing in ("uneven", "balanced"):
            x, ids, weights = make_tokens(T, H, E, k, routing, torch.bfloat16, dev, gen)
            check(routing, x, ids, weights, wgu, wd, dy)
        if n == 0:
            sentinel = torch.where(torch.rand(ids.shape, device=dev, generator=gen) < 0.3, ids + E, ids)
            check("ep sentinels", x, sentinel, weights, wgu, wd, dy)
            check("stride-0 dy", x, ids, weights, wgu, wd, torch.ones(1, 1, device=dev, dtype=dy.dtype).expand(T, H))
        unit = 2 * T * k * H * I
        for name, (fwd, bwd) in PATHS.items():
            kept = _saved(name, fwd(x, ids, weights, wgu, wd, save_h=True))
            for what, fn, flops in (
                ("forward (keep h)", lambda: fwd(x, ids, weights, wgu, wd, save_h=True), 3 * unit),
                ("backward (read h)", lambda: bwd(dy, x, ids, weights, wgu, wd, kept), 6 * unit),
            ):
                ms = bench_ms(fn, dev)
                tf = flops / ms / 1e9
                print(f"  time {name:10s} {what:20s} {ms:8.3f} ms  {tf:6.1f} TFLOP/s  {100 * tf / peak:5.1f}%", flush=True)


if __name__ == "__main__":
    main()
