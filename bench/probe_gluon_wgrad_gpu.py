#!/usr/bin/env python3
"""Probe: a warp-specialized K-ragged weight-gradient GEMM in Gluon, against CUTLASS, on expert-padded copies.

    PYTHONPATH=. python3 bench/probe_gluon_wgrad_gpu.py [--shape 30b] [--tokens 16384] [--seconds 2]
    PYTHONPATH=. python3 bench/probe_gluon_wgrad_gpu.py --compile      # CPU: compile for sm90, ptxas -v

bench/probe_gather_wgrad_gpu.py found the Triton K-ragged weight gradient 28-57% slower than CUTLASS even
when both operands come through TMA: without warp specialization each tile's ~16 K steps pay the
pipeline fill and the epilogue. This is the question before any gather: can an explicit Gluon ping-pong
(gluon_ragged's structure: one TMA load warp, two consumer warpgroups on alternate 128 x 128 tiles) run
out[e] = P_e^T Q_e over each expert's rows at CUTLASS's speed and joules?

TMA cannot stop at an expert's last row inside a tensor. Here each expert's rows start at a multiple of
64 and its segment is padded with zero rows (``pad``), so no K step crosses two experts and no masking is
needed: a layout the sorted copies could take in the product, since moe_fuse writes them itself.

    dW_gate_up[e]   = dh_e^T xs_e     P = dh [S', 2I], Q = xs [S', H]   (gathered: Q = x, rows src)
    dW_down[e]^T    = aw_e^T dys_e    P = aw [S', I],  Q = dys [S', H]  (gathered: Q = dy)

Two loaders: TMA of the padded copy of Q (one warp), or the gather (GATHER: four warps, each thread
cp.async-copies 8 16-byte pieces of the stage's rows x[src[r]] and arrives on the stage's barrier when
they land, ``cp.async.mbarrier.arrive.noinc``, the consumers fencing each stage before its wgmma; or, with
``--lags L``, the loader waits for the stage L steps back, fences it and arrives once). Results:
bench/results/probe_gluon_wgrad*_2026-12-02.log.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_gather_wgrad_gpu import SHAPES  # noqa: E402  (H, I, E, k)
BM, BN, BK = 128, 128, 64
STAGES = 5  # 32 KB a stage
LAG = 3  # the gathering loader fences and signals a stage this many steps after issuing it


@gluon.jit
def _loader(p, STAGES: gl.constexpr, GATHER: gl.constexpr, LAG: gl.constexpr):
    """TMA of P's stage; Q's by TMA of the sorted copy, or (GATHER) gathered rows through cp.async: every
    thread of this 4-warp partition copies its 16-byte pieces and arrives on the stage when they land."""
    (p_desc, q_desc, a_bufs, b_bufs, ready, empty, turn, offp_ptr, out_ptr, M, N, num_m, num_n, total, q_ptr, src_ptr,
     stride_q) = p
    BLOCK_K: gl.constexpr = p_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = p_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = q_desc.block_type.shape[1]
    gather: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # 16-byte pieces, a row's in one warp
    per_e = num_m * num_n
    it = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        e = t // per_e
        m0 = (t % per_e) // num_n * BLOCK_M
        n0 = (t % num_n) * BLOCK_N
        lo = gl.load(offp_ptr + e)
        hi = gl.load(offp_ptr + e + 1)
        # the gathered rows' indices two steps ahead: a load's latency is about one stage's MMA time
        if GATHER:
            rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, gather))
            src = gl.load(src_ptr + lo + rk, mask=lo + rk < hi, other=-1)
            src_next = gl.load(src_ptr + lo + BLOCK_K + rk, mask=lo + BLOCK_K + rk < hi, other=-1)
        for r0 in range(lo, hi, BLOCK_K):
            s = it % STAGES
            if GATHER:
                src_after = gl.load(src_ptr + r0 + 2 * BLOCK_K + rk, mask=r0 + 2 * BLOCK_K + rk < hi, other=-1)
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            if GATHER:
                mbarrier.expect(ready.index(s), p_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(p_desc, [r0, m0], ready.index(s), a_bufs.index(s))
                cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gather))
                ptrs = q_ptr + src.to(gl.int64)[:, None] * stride_q + cols[None, :]
                mask = (src >= 0)[:, None] & (cols < N)[None, :]  # padding rows: zeros
                async_copy.async_copy_global_to_shared(b_bufs.index(s), ptrs, mask=mask)
                if LAG == 0:  # each thread arrives when its copies land; the consumers fence
                    async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
                else:  # the stage LAG steps back has landed: fence it here and arrive once, for the partition
                    async_copy.commit_group()
                    if it >= LAG:
                        async_copy.wait_group(LAG)
                        fence_async_shared()
                        mbarrier.arrive(ready.index((it - LAG) % STAGES))
                src = src_next
                src_next = src_after
            else:
                mbarrier.expect(ready.index(s), p_desc.block_type.nbytes + q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(p_desc, [r0, m0], ready.index(s), a_bufs.index(s))
                tma.async_copy_global_to_shared(q_desc, [r0, n0], ready.index(s), b_bufs.index(s))
            it += 1
    if GATHER and LAG > 0:  # the last LAG stages
        async_copy.wait_group(0)
        fence_async_shared()
        for j in range(gl.maximum(it - LAG, 0), it):
            mbarrier.arrive(ready.index(j % STAGES))


@gluon.jit
def _consume(p, STAGES: gl.constexpr, GATHER: gl.constexpr, LAG: gl.constexpr, c: gl.constexpr):
    """Consumer c takes the program's tiles j = c, c + 2, ...; its K loop runs while the other writes."""
    (p_desc, q_desc, a_bufs, b_bufs, ready, empty, turn, offp_ptr, out_ptr, M, N, num_m, num_n, total, q_ptr, src_ptr,
     stride_q) = p
    BLOCK_K: gl.constexpr = p_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = p_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = q_desc.block_type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    per_e = num_m * num_n
    it = 0  # ring steps of every tile before this one (both consumers'), in the loader's order
    j = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        e = t // per_e
        lo = gl.load(offp_ptr + e)
        hi = gl.load(offp_ptr + e + 1)
        n_k = (hi - lo) // BLOCK_K
        if j % 2 == c:
            m0 = (t % per_e) // num_n * BLOCK_M
            n0 = (t % num_n) * BLOCK_N
            acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
            mbarrier.wait(turn.index(1 - c), (j // 2 - 1 + c) & 1, pred=j > 0)
            for kk in range(n_k):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                if GATHER and LAG == 0:  # cp.async wrote the stage through the generic proxy; wgmma reads through
                    fence_async_shared()  # the async one (with LAG, the loader fenced it)
                acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=kk > 0)
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=n_k > 0)
            mbarrier.arrive(turn.index(c), count=1)
            rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
            cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
            mask = (rows < M)[:, None] & (cols < N)[None, :]
            gl.store(out_ptr + e.to(gl.int64) * M * N + rows.to(gl.int64)[:, None] * N + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            it += n_k
        j += 1


@gluon.jit
def _consume_second(p, STAGES: gl.constexpr, GATHER: gl.constexpr, LAG: gl.constexpr):
    _consume(p, STAGES, GATHER, LAG, 1)


@gluon.jit
def _wgrad_kernel(p_desc, q_desc, offp_ptr, out_ptr, M, N, num_m, num_n, total, q_ptr, src_ptr, stride_q,
                  STAGES: gl.constexpr, GATHER: gl.constexpr, LAG: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(p_desc.dtype, [STAGES] + p_desc.block_type.shape, p_desc.layout)
    b_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        # the TMA's arrival, and each gathering thread's (LAG 0) or the gathering partition's
        mbarrier.init(ready.index(s), count=1 + (GATHER * (128 if LAG == 0 else 1)))
        mbarrier.init(empty.index(s), count=1)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    p = (p_desc, q_desc, a_bufs, b_bufs, ready, empty, turn, offp_ptr, out_ptr, M, N, num_m, num_n, total, q_ptr, src_ptr,
         stride_q)
    if GATHER:  # the loader needs registers for 8 gathered pieces a thread
        gl.warp_specialize([
            (_consume, (p, STAGES, GATHER, LAG, 0)),
            (_consume_second, (p, STAGES, GATHER, LAG)),
            (_loader, (p, STAGES, GATHER, LAG)),
        ], [4, 4], [216, 72])
    else:
        gl.warp_specialize([
            (_consume, (p, STAGES, GATHER, LAG, 0)),
            (_consume_second, (p, STAGES, GATHER, LAG)),
            (_loader, (p, STAGES, GATHER, LAG)),
        ], [4, 1], [240, 24])


def _desc(t, block):
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def gluon_wgrad(p, q, offp, E, sms, src=None, lag=0):
    """out [E, M, N] = P_e^T Q_e over each expert's padded rows [offp[e], offp[e + 1]); src (int32, one per padded
    row, -1 on padding): Q_e's rows are q[src] instead (gathered)."""
    M, N = p.shape[1], q.shape[1]
    out = torch.empty(E, M, N, dtype=p.dtype, device=p.device)
    num_m, num_n = -(-M // BM), -(-N // BN)
    total = E * num_m * num_n
    gather = src is not None
    # the consumers free a stage one step after its MMA, so the loader waits on stage it - STAGES + 1 before
    # signalling stage it - lag: past STAGES - 2 it waits on itself
    if not 0 <= lag <= STAGES - 2:
        raise ValueError(f"lag must be in [0, STAGES - 2 = {STAGES - 2}], got {lag}")
    q_desc = _desc(p[:, :BN] if gather else q, [BK, BN])  # unused when gathering: any descriptor of the block's type
    _wgrad_kernel[(min(sms, total),)](_desc(p, [BK, BM]), q_desc, offp, out, M, N, num_m, num_n, total, q,
                                      src if gather else offp, q.stride(0), STAGES, gather, lag, num_warps=4,
                                      maxnreg=168)
    return out


def pad(t, offsets, offp, rows):
    """t's rows with each expert's segment moved to start at offp[e], zero rows between."""
    counts = (offsets[1:] - offsets[:-1]).long()
    dest = torch.repeat_interleave(offp[:-1].long() - offsets[:-1].long(), counts) + torch.arange(
        int(offsets[-1]), device=t.device)
    out = torch.zeros(rows, t.shape[1], dtype=t.dtype, device=t.device)
    out[dest] = t[: int(offsets[-1])]
    return out


def compile_sm90_report(kernel, sig, constants, aligned, maxnreg=168):
    """Compile a Gluon kernel for sm90 on any machine (no GPU needed) and return (compiled, ptxas -v's report):
    shared memory, registers and spills. ``aligned``: the arguments the runtime would call 16-byte aligned."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    names = list(sig)
    attrs = {(names.index(n), ): [["tt.divisibility", 16]] for n in aligned}
    k = triton.compile(GluonASTSource(kernel, sig, constants, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "maxnreg": maxnreg})
    with tempfile.TemporaryDirectory() as d:
        open(d + "/k.ptx", "w").write(k.asm["ptx"])
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", d + "/k.ptx", "-o", d + "/k.cubin"],
                             capture_output=True, text=True)
    return k, out.stdout + out.stderr


def report_check(label, got, want):
    """One line: got's error relative to want, and whether they are bitwise equal."""
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    print(f"  {label} vs CUTLASS: rel err {err:.1e}, bitwise {torch.equal(got, want)}", flush=True)


def report_sustained(label, fn, seconds, flop, what=""):
    """One line: fn called back to back at the power cap for ``seconds`` (power.run_sustained): ms and NVML mJ per
    call, TFLOP/s of ``flop`` per call, the board's watts, SM clock and share of samples capped."""
    from power import run_sustained

    ms, smp = run_sustained(fn, seconds, batch=20)
    st, mj = smp.stats(), smp.mj_per_call
    print(f"  {label} {ms:.3f} ms/call, {'nan' if mj is None else f'{mj:.0f}'} mJ/call "
          f"({flop / ms / 1e9:.0f} TFLOP/s{what}), {st.get('watts', float('nan')):.0f} W, "
          f"{st.get('sm_mhz', float('nan')):.0f} MHz, capped {st.get('capped', float('nan')):.0%}", flush=True)


def check_then_time(name, ours, want, baselines, seconds, flop, as_want=lambda out: out, what=""):
    """Each of ``ours`` ({label: call}) checked against ``want`` (its output through ``as_want``), then the
    baselines ({label: call}) and ours timed at the power cap, one line each."""
    width = max(map(len, [*ours, *baselines]))
    for label, run in ours.items():
        got = run()
        torch.cuda.synchronize()
        report_check(f"{name:10s} {label:{width}s}", as_want(got), want)
    for label, fn in {**baselines, **ours}.items():
        report_sustained(f"{name:10s} {label:{width}s}", fn, seconds, flop, what)


def compile_sm90(gather, lag=0):
    from triton.runtime.jit import mangle_type

    pd = _desc(torch.empty(1024, 256, dtype=torch.bfloat16), [BK, BM])
    qd = _desc(torch.empty(1024, 256, dtype=torch.bfloat16), [BK, BN])
    sig = {"p_desc": mangle_type(pd), "q_desc": mangle_type(qd), "offp_ptr": "*i32", "out_ptr": "*bf16", "M": "i32",
           "N": "i32", "num_m": "i32", "num_n": "i32", "total": "i32", "q_ptr": "*bf16", "src_ptr": "*i32",
           "stride_q": "i32", "STAGES": "constexpr", "GATHER": "constexpr",
           "LAG": "constexpr"}
    # what the runtime's specialization says of 16-byte aligned pointers and multiples of 16
    k, report = compile_sm90_report(_wgrad_kernel, sig, {"STAGES": STAGES, "GATHER": gather, "LAG": lag},
                                    ("offp_ptr", "out_ptr", "M", "N", "q_ptr", "src_ptr", "stride_q"))
    print(f"GATHER={gather} LAG={lag}: shared {k.metadata.shared} B; wgmma {'wgmma.mma_async' in k.asm['ptx']}\n{report}")


def probe_args(**extra):
    """The Gluon probes' common arguments (shape, tokens, seconds at the cap, --compile), plus ``extra``
    ({flag: add_argument kwargs})."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="30b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--compile", action="store_true", help="compile for sm90 and print ptxas -v (no GPU needed)")
    for flag, kwargs in extra.items():
        ap.add_argument(flag, **kwargs)
    return ap.parse_args()


def padded_offsets(routing, block, label):
    """offsets with each expert's segment rounded up to a multiple of ``block`` rows (``pad``'s layout), and their
    total; prints the padding's share."""
    padded = (routing.counts.long() + block - 1) // block * block
    offp = torch.cat([padded.new_zeros(1), padded.cumsum(0)]).to(torch.int32)
    rows, S = int(offp[-1]), int(routing.offsets[-1])
    print(f"{torch.cuda.get_device_name()}; {label}: S={S}, padded rows {rows} (+{rows / S - 1:.1%})", flush=True)
    return offp, rows


def wgrad_inputs(shape, tokens, block_k=BK):
    """The weight-gradient probes' inputs (``routed_inputs``'s draws) and layouts: the routing, each expert's rows
    padded to a multiple of block_k (offp, rows), src (the token of each padded row, -1 on padding) and the cases
    {name: (P, the sorted copy of Q, Q, CUTLASS, whether ours is its transpose)}."""
    import types

    from probe_gather_wgrad_gpu import routed_inputs

    from moe_fuse.kernels.permute import expand_rows

    H, I, E, k = SHAPES[shape]
    T, S, dev = tokens, tokens * k, "cuda"
    x, dy, dh, aw, routing = routed_inputs(H, I, E, k, T, dev)  # the Triton probe's inputs, the same draws
    ends = routing.offsets[1:]
    pos = routing.pos.view(T, k)
    offp, rows = padded_offsets(routing, block_k, f"{shape} T={T}")
    xs, dys = expand_rows(x, pos), expand_rows(dy, pos)
    src = pad(routing.token.view(S, 1) + 1, routing.offsets, offp, rows).view(-1).to(torch.int32) - 1
    cases = {
        "dW_gate_up": (dh, xs, x, lambda: torch._grouped_mm(dh.t(), xs, offs=ends), False),
        "dW_down": (aw, dys, dy, lambda: torch._grouped_mm(dys.t(), aw, offs=ends), True),
    }
    return types.SimpleNamespace(E=E, S=S, sms=torch.cuda.get_device_properties(0).multi_processor_count,
                                 routing=routing, pos=pos, offp=offp, rows=rows, src=src, cases=cases)


def main():
    args = probe_args(**{
        "--lags": dict(type=lambda v: [int(x) for x in v.split(",")], default=[0, LAG],
                       help="gathered variants: 0 = per-thread noinc arrivals, consumers fence; L > 0 = the loader "
                            "fences and signals each stage L steps after issuing it"),
        "--once": dict(action="store_true", help="dW_gate_up once per loader, nothing timed (for ncu)")})
    if args.compile:
        return [compile_sm90(g, lag) for g, lag in ((False, 0), (True, 0), (True, LAG))]

    from moe_fuse.kernels.permute import expand_rows

    w = wgrad_inputs(args.shape, args.tokens)
    E, S, sms, routing, pos, offp, rows, src, cases = (w.E, w.S, w.sms, w.routing, w.pos, w.offp, w.rows, w.src,
                                                       w.cases)
    if args.once:
        p, q, q_src, _, _ = cases["dW_gate_up"]
        pp, qp = pad(p, routing.offsets, offp, rows), pad(q, routing.offsets, offp, rows)
        gluon_wgrad(pp, qp, offp, E, sms)
        gluon_wgrad(pp, q_src, offp, E, sms, src=src)
        torch.cuda.synchronize()
        return
    for name, (p, q, q_src, cutlass, transposed) in cases.items():
        flop = 2 * S * p.shape[1] * q.shape[1]
        pp, qp = pad(p, routing.offsets, offp, rows), pad(q, routing.offsets, offp, rows)
        want = cutlass()
        ours = {"Gluon ping-pong, padded": lambda: gluon_wgrad(pp, qp, offp, E, sms)}
        for lag in args.lags:
            ours[f"Gluon, gathered, lag {lag}"] = lambda lag=lag: gluon_wgrad(pp, q_src, offp, E, sms, src=src, lag=lag)
        check_then_time(name, ours, want, {"CUTLASS": cutlass, "expand + CUTLASS": lambda: (expand_rows(q_src, pos),
                                                                                           cutlass())},
                        args.seconds, flop, lambda out: out.transpose(1, 2) if transposed else out)


if __name__ == "__main__":
    main()
