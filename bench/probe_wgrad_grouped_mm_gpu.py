#!/usr/bin/env python3
"""Probe: the two weight gradients through torch._grouped_mm (CUTLASS, K-grouped) vs our Triton wgrad.

    PYTHONPATH=. python3 bench/probe_wgrad_grouped_mm_gpu.py

torch._grouped_mm(a [M, S], b [S, N], offs) computes out[e] = a[:, rows of e] @ b[rows of e, :]
when both operands are 2-D: the wgrad shape. Its operands must be in expert order, so the
token-indexed one (x for dW_gate_up, dy for dW_down) is gathered first; the gather is timed too.
Checks: each result against our Triton wgrad (relative norm), an expert with zero rows (its block
must be zeros), two runs bitwise equal.
"""

import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from check_kernels_gpu import make_tokens, rel_err  # noqa: E402
from moe_fuse.kernels import route  # noqa: E402
from moe_fuse.kernels.backward import _wgrad_config, experts_by_rows, wgrad  # noqa: E402

SHAPES = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8)}


def ms(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def main():
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    for shape, T in (("30b", 4096), ("30b", 16384), ("235b", 4096), ("235b", 16384)):
        H, I, E, k = SHAPES[shape]
        x, ids, _ = make_tokens(T, H, E, k, "balanced", bf, dev, gen)
        ids[ids == 5] = 6  # expert 5 gets no rows
        S = T * k
        dy = torch.randn(T, H, device=dev, dtype=bf, generator=gen)
        aw = torch.randn(S, I, device=dev, dtype=bf, generator=gen)
        dh = torch.randn(S, 2 * I, device=dev, dtype=bf, generator=gen)
        r = route(ids, E)
        by_load = experts_by_rows(r)
        ends = r.offsets[1:].contiguous()  # int32 cumulative row ends per expert
        token = (r.order // k).long()

        def ours_gu():
            return wgrad(dh, False, x, True, r, E, k, bf, config=_wgrad_config(S, E, bf, "gate_up"), experts_by_load=by_load)

        def ours_down():
            return wgrad(dy, True, aw, False, r, E, k, bf, config=_wgrad_config(S, E, bf, "down"), experts_by_load=by_load)

        def gmm_gu():
            return torch._grouped_mm(dh.t(), x[token], offs=ends)

        def gmm_down():
            return torch._grouped_mm(dy[token].t(), aw, offs=ends)

        for name, ours, gmm in (("dW_gate_up", ours_gu, gmm_gu), ("dW_down", ours_down, gmm_down)):
            try:
                a = ours()
                junk = torch.full_like(a, float("nan"))  # freed: the next output likely reuses this block
                del junk
                b = gmm()
                b2 = gmm()
                print(f"{shape} T={T} {name}: ours {ms(ours):.3f} ms | grouped_mm incl. gather {ms(gmm):.3f} ms | "
                      f"gather alone {ms(lambda: x[token]):.3f} ms | rel err {rel_err(b.float(), a.float()):.1e} | "
                      f"empty expert zeros: {bool((b[5] == 0).all())} | bitwise repeat: {torch.equal(b, b2)}")
            except Exception as e:
                print(f"{shape} T={T} {name}: {type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    main()
