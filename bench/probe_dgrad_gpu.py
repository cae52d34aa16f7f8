#!/usr/bin/env python3
"""Why is the saved-h dgrad (one accumulator, 2*S*H*I FLOPs) as slow as the recomputing one (6*S*H*I)?

A diagnostic, not a benchmark of the product: one simplified copy of the dgrad main loop with
switches, each variant timed alone on the 30B layer at T=16384 (balanced routing):

    A_GATHER   dy rows gathered by token (as in dgrad) | read from a pre-gathered sorted copy
    B_KMAJOR   W_down tile read [BK, BN] from [E, H, I] (N contiguous, as in dgrad) | from a
               transposed copy [E, I, H] (K contiguous, as the forward GEMMs read their weights)
    EPILOGUE   0: store g only; 1: + read h and write d_h, aw (the dgrad epilogue)

    PYTHONPATH=. python3 bench/probe_dgrad_gpu.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from check_kernels_gpu import bench_ms, make_tokens, make_weights, matmul_peak  # noqa: E402
from moe_fuse.kernels import route  # noqa: E402


@triton.jit
def _probe_kernel(dy_ptr, dys_ptr, order_ptr, counts_ptr, wd_ptr, wdt_ptr, h_ptr, g_ptr, dh_ptr, aw_ptr,
                  S, H, I, E, num_m_tiles,
                  TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, E_P2: tl.constexpr,
                  A_GATHER: tl.constexpr, B_KMAJOR: tl.constexpr, EPILOGUE: tl.constexpr):
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(I, BLOCK_N)
    per_group = GROUP_M * num_n_tiles
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    bins = tl.arange(0, E_P2)
    counts = tl.load(counts_ptr + bins, mask=bins < E, other=0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    if pid_m >= tl.sum(tiles, axis=0):
        return
    before = tl.cumsum(tiles, axis=0) <= pid_m
    expert = tl.sum(before.to(tl.int32), axis=0)
    tile_in_expert = pid_m - tl.sum(tl.where(before, tiles, 0), axis=0)
    row_begin = tl.sum(tl.where(before, counts, 0), axis=0)
    row_count = tl.sum(tl.where(bins == expert, counts, 0), axis=0)
    m = tile_in_expert * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = m < row_count
    pos = row_begin + m
    src = tl.load(order_ptr + pos, mask=row_valid, other=0)
    token = (src // TOP_K).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    if A_GATHER:
        a_ptrs = dy_ptr + token[:, None] * H + kk[None, :]
    else:
        a_ptrs = dys_ptr + tl.where(row_valid, pos, 0).to(tl.int64)[:, None] * H + kk[None, :]
    e64 = expert.to(tl.int64)
    if B_KMAJOR:
        b_ptrs = wdt_ptr + e64 * I * H + n[None, :] * H + kk[:, None]  # [BK, BN] of W_down^T[e] [I, H]
    else:
        b_ptrs = wd_ptr + e64 * H * I + kk[:, None] * I + n[None, :]  # [BK, BN] of W_down[e] [H, I]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K if B_KMAJOR else BLOCK_K * I
    pos64 = pos.to(tl.int64)
    mask = row_valid[:, None]
    if EPILOGUE:
        h_ptrs = h_ptr + pos64[:, None] * (2 * I) + n[None, :]
        gate = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptrs + I, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        act = gate * sig
        d_gate = acc * up * sig * (1.0 + gate * (1.0 - sig))
        dh_ptrs = dh_ptr + pos64[:, None] * (2 * I) + n[None, :]
        tl.store(dh_ptrs, d_gate.to(tl.bfloat16), mask=mask)
        tl.store(dh_ptrs + I, (acc * act).to(tl.bfloat16), mask=mask)
        tl.store(aw_ptr + pos64[:, None] * I + n[None, :], (act * up).to(tl.bfloat16), mask=mask)
    else:
        tl.store(g_ptr + pos64[:, None] * I + n[None, :], acc.to(tl.bfloat16), mask=mask)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    H, I, E, k, T = 2048, 768, 128, 8, 16384
    S = T * k
    peak = matmul_peak(dev)
    w_gate_up, w_down = make_weights(H, I, E, torch.bfloat16, dev, gen)
    wdt = w_down.transpose(1, 2).contiguous()
    x, ids, weights = make_tokens(T, H, E, k, "balanced", torch.bfloat16, dev, gen)
    dy = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
    r = route(ids, E)
    dys = dy[(r.order // k).long()].contiguous()
    h = torch.randn(S, 2 * I, device=dev, dtype=torch.bfloat16, generator=gen)
    g = torch.empty(S, I, device=dev, dtype=torch.bfloat16)
    dh = torch.empty(S, 2 * I, device=dev, dtype=torch.bfloat16)
    aw = torch.empty(S, I, device=dev, dtype=torch.bfloat16)
    flops = 2 * S * H * I
    rows = []
    want = None
    for bm, bn, bk, warps, stages in [(128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 256, 64, 8, 3)]:
        num_m = triton.cdiv(S, bm) + E
        grid = (num_m * triton.cdiv(I, bn),)
        for a_gather in (True, False):
            for b_kmajor in (False, True):
                for epi in (0, 1):
                    def run():
                        _probe_kernel[grid](dy, dys, r.order, r.counts, w_down, wdt, h, g, dh, aw, S, H, I, E, num_m,
                                            TOP_K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, E_P2=128,
                                            A_GATHER=a_gather, B_KMAJOR=b_kmajor, EPILOGUE=epi,
                                            num_warps=warps, num_stages=stages)
                    try:
                        run()
                        if epi == 0:
                            torch.cuda.synchronize()
                            if want is None:
                                want = g.clone()
                            ok = torch.allclose(g.float(), want.float(), rtol=2e-2, atol=2e-2)
                        else:
                            ok = None
                        ms = bench_ms(run, dev)
                    except Exception as e:  # a config that does not fit is reported, not fatal
                        rows.append(dict(cfg=f"{bm}x{bn}x{bk} w{warps} s{stages}", error=repr(e)[:200]))
                        continue
                    row = dict(cfg=f"{bm}x{bn}x{bk} w{warps} s{stages}", a_gather=a_gather, b_kmajor=b_kmajor,
                               epilogue=epi, ms=ms, pct_peak=100 * flops / ms / 1e9 / peak, same_g=ok)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_dgrad_gpu.json").write_text(json.dumps(dict(peak=peak, rows=rows), indent=1))


if __name__ == "__main__":
    main()
