#!/usr/bin/env python3
"""Expert weights stored transposed ([E, in, out]: transformers' ``is_transposed``, Aria) on the GPU.

    PYTHONPATH=. python3 bench/check_transposed_gpu.py

1. A Qwen3-30B-A3B-shaped experts layer (H 2048, I 768, E 128, k 8), bf16, at T=4096 (torch._grouped_mm
   for every GEMM) and T=16384 (the row-ragged GEMMs in ragged_gemm): the training path with the weights
   as transposed views of [E, in, out] tensors against the same weights contiguous. y and every gradient:
   bitwise equal or not, the relative error against the contiguous run, against fp32 (T=4096), whether two
   runs are bitwise equal, and the weight gradients' strides.
2. The op's forward + backward time, contiguous vs transposed, in turn; at T=16384 each GEMM of the path
   alone in both layouts (do_bench, in turn, three rounds).
3. The forward without h (inference): contiguous weights through the fused Triton forward, transposed ones
   through the grouped_mm path (what ``kernels.experts_forward`` picks for them) and, for scale, through the
   fused Triton forward with pointer-loaded weights; y against the contiguous run.
The compiled path (transformers' Aria block under backend="moe_fuse") is tested on the CPU
(tests/test_families.py, tests/test_rewrite_graph.py, transformers 5.24): in transformers 5.17, on the GPU
machine, Aria's experts module has no ``is_transposed`` layout.
"""

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from check_swiglu_limit_gpu import case, rel  # noqa: E402
from moe_fuse import kernels, reference  # noqa: E402


def training_path(x, ids, w, wgu, wd, dy):
    y, h, routing, xs, aw = kernels.experts_forward(x, ids, w, wgu, wd, save_h=True, keep_rows=True)
    return (y, *kernels.experts_backward(dy, x, ids, w, wgu, wd, h, routing=routing, xs=xs, aw=aw))


def layer_check(T):
    x, ids, w, wgu, wd, dy = case(T)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (wgu, wd)]
    assert all(kernels.transposed(v) for v in views)
    want = training_path(x, ids, w, wgu, wd, dy)
    got, again = training_path(x, ids, w, *views, dy), training_path(x, ids, w, *views, dy)
    names = ["y", "dx", "d_weights", "dW_gate_up", "dW_down"]
    print(f"  T={T}: transposed views vs contiguous weights")
    if T <= 4096:
        f32 = [t.float() if t.is_floating_point() else t for t in (x, ids, w, wgu, wd)]
        ref = (reference.experts_forward(*f32), *reference.experts_backward(dy.float(), *f32))
    for i, name in enumerate(names):
        g, c = got[i], want[i]
        if g.dim() == 3:
            g_mem = g.transpose(1, 2)
            layout = (f"grad strides {g.stride()} (view {views[i - 3].stride()}), "
                      f"stored layout contiguous {g_mem.is_contiguous()}")
        else:
            layout = ""
        line = (f"    {name:<11} bitwise equal to contiguous: {torch.equal(g, c)}, rel {rel(g, c):.1e}, "
                f"repeat bitwise {torch.equal(g, again[i])}")
        if T <= 4096:
            line += f", vs fp32 {rel(g, ref[i]):.1e} (contiguous {rel(c, ref[i]):.1e})"
        print(line + ("; " + layout if layout else ""), flush=True)
    import moe_fuse.ops  # noqa: F401

    def op_step(ws):
        torch.ops.moe_fuse.experts(xg, ids, w, *ws, True)[0].backward(dy)

    xg = x.clone().requires_grad_()
    leaves_c = [t.clone().requires_grad_() for t in (wgu, wd)]
    stored = [t.transpose(1, 2).contiguous().requires_grad_() for t in (wgu, wd)]
    contiguous = (lambda: op_step(leaves_c), [xg, *leaves_c])
    views_of_stored = (lambda: op_step([s.transpose(1, 2) for s in stored]), [xg, *stored])
    for r in range(6):  # in turn, the order swapped every round
        pair = (contiguous, views_of_stored) if r % 2 == 0 else (views_of_stored, contiguous)
        ms = {id(fn): do_bench(fn, warmup=10, rep=200, grad_to_none=g) for fn, g in pair}
        print(f"    round {r}: op fwd+bwd contiguous {ms[id(contiguous[0])]:.3f} ms, transposed "
              f"{ms[id(views_of_stored[0])]:.3f} ms", flush=True)


def gemm_times(T, rounds=3):
    from moe_fuse.kernels import grouped_mm_path as gp
    from moe_fuse.kernels.permute import expand_rows

    x, ids, w, wgu, wd, dy = case(T)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (wgu, wd)]
    S = ids.numel()
    routing = kernels.route(ids, wgu.shape[0])
    ends = routing.offsets[1:]
    tiles = gp._tiles(routing, S)
    xs = expand_rows(x, routing.pos.view(ids.shape))
    dys = expand_rows(dy, routing.pos.view(ids.shape))
    h = gp._row_gemm(xs, wgu, tiles, ends, w_kmajor=True)
    aw = torch.randn(S, wd.shape[2], device="cuda", dtype=torch.bfloat16)
    dh = torch.randn_like(h)
    gemms = {
        "gate_up": lambda g, d: gp._row_gemm(xs, g, tiles, ends, w_kmajor=True),
        "down": lambda g, d: gp._row_gemm(aw, d, tiles, ends, w_kmajor=True),
        "dgrad": lambda g, d: gp._row_gemm(dys, d, tiles, ends, w_kmajor=False),
        "dx": lambda g, d: gp._row_gemm(dh, g, tiles, ends, w_kmajor=False),
        "dW_gate_up": lambda g, d: gp._wgrad(dh, xs, routing.offsets, gp.transposed(g)),
        "dW_down": lambda g, d: gp._wgrad(dys, aw, routing.offsets, gp.transposed(d)),
    }
    print(f"  T={T}, each GEMM alone ({'ragged_gemm' if tiles is not None else 'torch._grouped_mm'} for the "
          f"row-ragged ones), ms contiguous / transposed:")
    for name, fn in gemms.items():
        a, b = fn(wgu, wd), fn(*views)
        same = torch.equal(a, b)
        times = []
        for _ in range(rounds):
            times.append((do_bench(lambda: fn(wgu, wd), warmup=10, rep=100),
                          do_bench(lambda: fn(*views), warmup=10, rep=100)))
        print(f"    {name:<11} " + "  ".join(f"{c:.3f} / {t:.3f}" for c, t in times) + f"   bitwise equal: {same}",
              flush=True)


def inference(T, rounds=3):
    from moe_fuse.kernels import grouped_mm_path as gp

    x, ids, w, wgu, wd, _ = case(T)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (wgu, wd)]

    def triton_fused():
        gp.ENABLED = False
        try:
            return kernels.experts_forward(x, ids, w, *views)
        finally:
            gp.ENABLED = True

    runs = {"contiguous (fused Triton)": lambda: kernels.experts_forward(x, ids, w, wgu, wd),
            "transposed (grouped_mm path)": lambda: kernels.experts_forward(x, ids, w, *views),
            "transposed (fused Triton, pointer loads)": triton_fused}
    want = runs["contiguous (fused Triton)"]()
    print(f"  T={T}, forward without h:")
    for name, fn in runs.items():
        times = [do_bench(fn, warmup=10, rep=100) for _ in range(rounds)]
        print(f"    {name:<42} " + " / ".join(f"{t:.3f}" for t in times) + f" ms; y rel {rel(fn(), want):.1e}",
              flush=True)


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for T in (4096, 16384):
        layer_check(T)
    gemm_times(16384)
    for T in (4096, 16384):
        inference(T)


if __name__ == "__main__":
    main()
