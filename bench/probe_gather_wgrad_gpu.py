#!/usr/bin/env python3
"""Probe: the two weight gradients as Triton GEMMs that gather one operand along K, against CUTLASS on copies.

    PYTHONPATH=. python3 bench/probe_gather_wgrad_gpu.py [--shape 30b] [--tokens 16384] [--seconds 3]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/probe_gather_wgrad_gpu.py --check     # CPU, small shapes

The 30B T=16384 step moves 13.5 GB, and the expert-sorted copies xs = x[tok] and dys = dy[tok] take ~1.8 GB
of it each (written once, read by two GEMMs: bench/results/ncu_layer_2026-12-02.log). They can only go if
every GEMM that reads them gathers its rows. For gate_up and dgrad that is ragged_gemm's A rows (tried in
4c82ae0: 5-8% slower). This probe sizes the other half, the weight gradients, which CUTLASS cannot do:

    dW_gate_up[e] = sum_{r in e} dh[r]^T x[tok r]      P = dh [S, 2I] (sorted), Q = x  [T, H] (gathered)
    dW_down[e]^T  = sum_{r in e} aw[r]^T dy[tok r]     P = aw [S, I]  (sorted), Q = dy [T, H] (gathered)

one kernel: out[e] = P_e^T Q[src_e] (dW_down stored transposed through strides), a persistent grid over
(expert, M tile, N tile), the K loop over the expert's rows: P through TMA (rows past the expert are
multiplied by Q's masked zeros), Q through pointer loads of the gathered rows. It prints, per GEMM: the
error against CUTLASS and whether it is bitwise equal, then at the power cap (bench/power.run_sustained) ms
and NVML mJ per call of CUTLASS on the copy, expand_rows + CUTLASS (what the copy costs) and each setting.
Whether the project pays: the gathered kernel's joules against expand + CUTLASS.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8)}  # H, I, E, k
SETTINGS = [  # block_m, block_n, block_k, num_warps, num_stages
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (256, 128, 64, 8, 3),
]


@triton.jit
def _gather_wgrad_kernel(
    p_ptr,  # P [S, M], rows sorted by expert
    p_desc,  # P, blocks [BLOCK_K, BLOCK_M] (USE_TMA)
    q_ptr,  # Q [Tq, N], the rows gathered
    q_desc,  # Q, blocks [BLOCK_K, BLOCK_N] (Q_TMA: Q is already sorted, src is not read; a diagnosis)
    src_ptr,  # [S] int32: the row of Q that sorted row r reads
    offsets_ptr,  # [E + 1] int32
    out_ptr,  # out[e, m, n] at e * stride_oe + m * stride_om + n * stride_on
    M,
    N,
    E,
    stride_p,
    stride_q,
    stride_oe,
    stride_om,
    stride_on,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_TMA: tl.constexpr,
    Q_TMA: tl.constexpr,
    IEEE: tl.constexpr,
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_e = num_m * num_n
    for t in tl.range(tl.program_id(0), E * per_e, num_programs):
        e = t // per_e
        m0 = (t % per_e) // num_n * BLOCK_M
        n0 = (t % num_n) * BLOCK_N
        lo = tl.load(offsets_ptr + e)
        hi = tl.load(offsets_ptr + e + 1)
        ms = m0 + tl.arange(0, BLOCK_M)
        ns = n0 + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(lo, hi, BLOCK_K):
            r = r0 + tl.arange(0, BLOCK_K)
            live = r < hi
            if Q_TMA:
                q = tl.where(live[:, None], q_desc.load([r0, n0]), 0.0)
            else:
                src = tl.load(src_ptr + r, mask=live, other=0).to(tl.int64)
                q = tl.load(q_ptr + src[:, None] * stride_q + ns[None, :], mask=live[:, None] & (ns < N)[None, :],
                            other=0.0)
            if USE_TMA:
                p = p_desc.load([r0, m0])  # rows past hi: the next expert's, times q's zero rows
            else:
                p = tl.load(p_ptr + r.to(tl.int64)[:, None] * stride_p + ms[None, :],
                            mask=live[:, None] & (ms < M)[None, :], other=0.0)
            if IEEE:  # the interpreter's bf16 tl.dot is wrong in triton 3.6
                acc = tl.dot(tl.trans(p.to(tl.float32)), q.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(tl.trans(p), q, acc)
        out = out_ptr + e.to(tl.int64) * stride_oe + ms[:, None] * stride_om + ns[None, :] * stride_on
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(ms < M)[:, None] & (ns < N)[None, :])


def gather_wgrad(p, q, src, offsets, out, *, transposed, setting, sms, q_tma=False):
    """out [E, M, N] (transposed: out [E, N, M]) = P_e^T Q[src_e] per expert; q_tma: Q is the sorted copy,
    loaded through TMA (src unused)."""
    bm, bn, bk, warps, stages = setting
    S, M = p.shape
    N = q.shape[1]
    E = offsets.numel() - 1
    interpret = not p.is_cuda
    use_tma = not interpret
    p_desc = q_desc = None
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        p_desc = TensorDescriptor.from_tensor(p, [bk, bm])
        if q_tma:
            q_desc = TensorDescriptor.from_tensor(q, [bk, bn])
    so = (out.stride(0), out.stride(2), out.stride(1)) if transposed else (out.stride(0), out.stride(1), out.stride(2))
    tiles = E * triton.cdiv(M, bm) * triton.cdiv(N, bn)
    grid = min(tiles, sms)
    _gather_wgrad_kernel[(grid,)](
        p, p_desc, q, q_desc, src, offsets, out, M, N, E, p.stride(0), q.stride(0), *so, grid,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, USE_TMA=use_tma, Q_TMA=q_tma, IEEE=interpret, num_warps=warps, num_stages=stages,
    )
    return out


def reference(p, q, src, offsets):
    E = offsets.numel() - 1
    out = []
    for e in range(E):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        out.append(p[lo:hi].double().t() @ q[src[lo:hi].long()].double())
    return torch.stack(out)


def routed_inputs(H, I, E, k, T, dev):
    """Both weight-gradient probes' inputs (bf16, seed 0): x, dy [T, H], dh [S, 2I], aw [S, I], and the routing
    of x's rows by a random router (uneven counts, as a real one gives)."""
    from moe_fuse.kernels.routing import route

    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(torch.bfloat16)

    x, dy = rnd(T, H), rnd(T, H)
    logits = (x @ rnd(E, H, scale=H**-0.5).t()).float()
    ids = torch.topk(logits.softmax(-1), k, dim=-1).indices.to(torch.int32)
    routing = route(ids, E)
    return x, dy, rnd(T * k, 2 * I), rnd(T * k, I), routing


def check_cpu():
    """Interpreter: both layouts, an empty expert, uneven experts, against float64."""
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 17, 33, 1], dtype=torch.int32)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).to(torch.int32)])
    S, T, M, N = int(counts.sum()), 13, 24, 40
    src = torch.randint(0, T, (S,), dtype=torch.int32)
    p, q = torch.randn(S, M).to(torch.bfloat16), torch.randn(T, N).to(torch.bfloat16)
    want = reference(p, q, src, offsets)
    for transposed in (False, True):
        out = torch.full((5, N, M) if transposed else (5, M, N), float("nan"), dtype=torch.bfloat16)
        gather_wgrad(p, q, src, offsets, out, transposed=transposed, setting=(16, 16, 16, 4, 1), sms=3)
        got = out.transpose(1, 2) if transposed else out
        err = ((got.double() - want).norm() / want.norm()).item()
        print(f"transposed={transposed}: rel err {err:.2e}, empty expert zero: {bool((got[1] == 0).all())}")
        assert err < 1e-2 and bool((got[1] == 0).all())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="30b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--diagnose", action="store_true", help="dW_gate_up at the first setting: gathered, "
                    "pointer loads of the sorted copy, TMA of the sorted copy (do_bench ms)")
    args = ap.parse_args()
    if args.check:
        return check_cpu()

    from power import run_sustained

    from moe_fuse.kernels.permute import expand_rows

    H, I, E, k = SHAPES[args.shape]
    T, S, dev, bf = args.tokens, args.tokens * k, "cuda", torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x, dy, dh, aw, routing = routed_inputs(H, I, E, k, T, dev)
    ends = routing.offsets[1:]
    pos = routing.pos.view(T, k)
    print(f"{torch.cuda.get_device_name()}; {args.shape} T={T}: S={S}, rows per expert "
          f"{routing.counts.min().item()}-{routing.counts.max().item()}", flush=True)
    cases = {  # name: P, Q, out shape, transposed, CUTLASS on the copy (a, b), FLOPs
        "dW_gate_up": (dh, x, (E, 2 * I, H), False),
        "dW_down": (aw, dy, (E, H, I), True),
    }
    if args.diagnose:
        from triton.testing import do_bench

        p, q, shape, transposed = cases["dW_gate_up"]
        copy = expand_rows(q, pos)
        rows = torch.arange(S, device=dev, dtype=torch.int32)
        for setting in SETTINGS:
            out = torch.empty(shape, device=dev, dtype=bf)
            for label, qq, src, q_tma in (("gathered", q, routing.token, False), ("copy, pointer loads", copy, rows, False),
                                          ("copy, TMA", copy, rows, True)):
                fn = lambda: gather_wgrad(p, qq, src, routing.offsets, out, transposed=False, setting=setting, sms=sms,
                                          q_tma=q_tma)
                print(f"  dW_gate_up {setting} {label:22s} {do_bench(fn, warmup=20, rep=200):.3f} ms", flush=True)
        print(f"  CUTLASS on the copy {do_bench(lambda: torch._grouped_mm(p.t(), copy, offs=ends), warmup=20, rep=200):.3f} ms")
        return
    for name, (p, q, shape, transposed) in cases.items():
        flop = 2 * S * p.shape[1] * q.shape[1]
        copy = expand_rows(q, pos)
        # CUTLASS as the layer runs it: dW_gate_up = dh^T xs, dW_down = dys^T aw
        cutlass = (lambda: torch._grouped_mm(p.t(), copy, offs=ends)) if not transposed else \
            (lambda: torch._grouped_mm(copy.t(), p, offs=ends))
        want = cutlass()
        torch.cuda.synchronize()

        def report(label, fn, extra=""):
            ms, smp = run_sustained(fn, args.seconds, batch=20)
            st, mj = smp.stats(), smp.mj_per_call
            print(f"  {name:10s} {label:24s} {ms:.3f} ms/call, {'nan' if mj is None else f'{mj:.0f}'} mJ/call "
                  f"({flop / ms / 1e9:.0f} TFLOP/s), {st.get('watts', float('nan')):.0f} W, "
                  f"{st.get('sm_mhz', float('nan')):.0f} MHz, capped {st.get('capped', float('nan')):.0%}{extra}",
                  flush=True)

        report("CUTLASS on the copy", cutlass)
        report("expand + CUTLASS", lambda: (expand_rows(q, pos), cutlass()))
        for setting in SETTINGS:
            label = "x".join(map(str, setting[:3])) + f" w{setting[3]} s{setting[4]}"
            out = torch.full(shape, float("nan"), device=dev, dtype=bf)
            try:
                gather_wgrad(p, q, routing.token, routing.offsets, out, transposed=transposed, setting=setting, sms=sms)
                torch.cuda.synchronize()
            except Exception as exc:  # a setting that does not compile or fit: say so, go on
                print(f"  {name:10s} {label:24s} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            err = ((out.float() - want.float()).norm() / want.float().norm()).item()
            report(label, lambda: gather_wgrad(p, q, routing.token, routing.offsets, out, transposed=transposed,
                                               setting=setting, sms=sms),
                   f"; vs CUTLASS rel err {err:.1e}, bitwise {torch.equal(out, want)}")


if __name__ == "__main__":
    main()
