#!/usr/bin/env python3
"""Probe: the K-ragged weight gradient with both consumers on one 256 x 128 tile, so a gathered stage feeds
twice the MMAs, and the epilogue through shared memory and a TMA store.

    PYTHONPATH=. python3 bench/probe_gluon_wgrad_coop_gpu.py [--shape 30b] [--tokens 16384] [--seconds 2]
    PYTHONPATH=. python3 bench/probe_gluon_wgrad_coop_gpu.py --compile      # CPU: compile for sm90, ptxas -v

bench/probe_gluon_wgrad_gpu.py (ping-pong: two consumer warpgroups on alternate 128 x 128 tiles) ran dW_gate_up
at 30B T=16384 in 1.55 ms with both operands through TMA (CUTLASS 1.46), and 2.19 ms with Q's rows gathered by
a 4-warp cp.async loader: the loader's supply limited it (eighteenth session, bench/KERNELS_NOTES.md). Here the
two consumers share each stage's gathered Q tile [64, 128], each multiplying its own 128 columns of P (two TMA
boxes), so the gathered bytes per FLOP halve. Both consumers end a tile together, so the epilogue cannot
overlap the other's K loop as in ping-pong; instead each writes its bf16 tile to a shared buffer and hands it to
a TMA store, and waits for that store only before it reuses the buffer one tile later. In case halving the
gathered bytes per FLOP is not enough, the gathered variants also run with 8 loader warps (4 pieces a thread a
stage instead of 8; 16 warps, so the partitions get 200 / 200 / 56 registers).

The TMA variant needs the ping-pong probe's layout (each expert's rows padded to a multiple of 64, ``pad``, so no
K step crosses two experts). The gathered variants need no padding: they run on the sorted tensors as moe_fuse
writes them, Q = x (or dy) gathered at routing.token and masked to zeros past each expert's end.
Prints the error against CUTLASS and bitwise equality, then at the power cap ms and NVML mJ per call of
CUTLASS, expand + CUTLASS, this kernel on the padded copy (TMA) and gathered (cp.async).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_gluon_wgrad_gpu import compile_sm90_report, probe_args  # noqa: E402

from gluon_gathered import gather_stage, max_regs  # noqa: E402  (the rows GEMM's)

from moe_fuse.kernels.gluon_wgrad import store_tile, tile_of  # noqa: E402  (the product kernel's)

HALF, BN, BK = 128, 128, 64  # a tile: 2 x HALF of P's columns (one half per consumer) x BN of Q's
STAGES = 3  # a stage: P 2 x 16 KB + Q 16 KB; with the two 32 KB epilogue buffers 208 KB of shared memory


@gluon.jit
def _loader(p, STAGES: gl.constexpr, GATHER: gl.constexpr, EPI_TMA: gl.constexpr, LW: gl.constexpr):
    """Each stage: P's two halves by TMA; Q by TMA of the padded copy, or (GATHER) its rows gathered through
    cp.async by this LW-warp partition, every thread arriving on the stage when its pieces land."""
    (p_desc, q_desc, out_desc, a_bufs, b_bufs, epi, ready, empty, offp_ptr, M, num_m, num_n, total, q_ptr, src_ptr,
     stride_q, out_ptr) = p
    BLOCK_K: gl.constexpr = p_desc.block_type.shape[0]
    HALF_M: gl.constexpr = p_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = q_desc.block_type.shape[1]
    gather: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [LW, 1], [1, 0])  # 16-byte pieces, a row's in one warp
    per_e = num_m * num_n
    it = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        e, m0, n0, lo, hi = tile_of(t, offp_ptr, num_n, per_e, HALF_M, BLOCK_N)
        for r0 in range(lo, hi, BLOCK_K):  # the last step may run past hi: its gathered rows are zeros
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            if GATHER:
                mbarrier.expect(ready.index(s), 2 * p_desc.block_type.nbytes)
            else:
                mbarrier.expect(ready.index(s), 2 * p_desc.block_type.nbytes + q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(p_desc, [r0, m0], ready.index(s), a_bufs.index(2 * s))
            tma.async_copy_global_to_shared(p_desc, [r0, m0 + HALF_M], ready.index(s), a_bufs.index(2 * s + 1))
            if GATHER:
                rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, gather))
                src = gl.load(src_ptr + r0 + rk, mask=r0 + rk < hi, other=-1)  # -1: a zero row
                cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gather))
                gather_stage(b_bufs.index(s), ready.index(s), q_ptr + src.to(gl.int64) * stride_q, src >= 0, cols,
                             stride_q)
            else:
                tma.async_copy_global_to_shared(q_desc, [r0, n0], ready.index(s), b_bufs.index(s))
            it += 1


@gluon.jit
def _consume(p, STAGES: gl.constexpr, GATHER: gl.constexpr, EPI_TMA: gl.constexpr, TRANS_OUT: gl.constexpr,
             c: gl.constexpr):
    """Consumer c: columns [c * HALF, (c + 1) * HALF) of every tile's 2 * HALF."""
    (p_desc, q_desc, out_desc, a_bufs, b_bufs, epi, ready, empty, offp_ptr, M, num_m, num_n, total, q_ptr, src_ptr,
     stride_q, out_ptr) = p
    BLOCK_K: gl.constexpr = p_desc.block_type.shape[0]
    HALF_M: gl.constexpr = p_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = q_desc.block_type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    trans: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [BLOCK_N, HALF_M], 16 B along M
    per_e = num_m * num_n
    it = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        e, m0, n0, lo, hi = tile_of(t, offp_ptr, num_n, per_e, HALF_M, BLOCK_N)
        m0 += c * HALF_M
        n_k = gl.cdiv(hi - lo, BLOCK_K)
        acc = gl.zeros((HALF_M, BLOCK_N), dtype=gl.float32, layout=layout)
        for kk in range(n_k):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            if GATHER:  # cp.async wrote the stage through the generic proxy; wgmma reads through the async one
                fence_async_shared()
            acc = warpgroup_mma(a_bufs.index(2 * s + c).permute((1, 0)), b_bufs.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=kk > 0)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=n_k > 0)
        if TRANS_OUT:  # out [E, N, M]: the tile through its shared buffer, read back transposed, stored along M
            gl.thread_barrier()  # every thread has read the buffer's tile before
            epi.index(c).store(acc.to(gl.bfloat16))
            gl.thread_barrier()
            t_out = epi.index(c).permute((1, 0)).load(trans)
            rm = m0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(0, trans))
            rn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, trans))
            gl.store(out_ptr + (e.to(gl.int64) * stride_q + rn.to(gl.int64))[:, None] * M + rm[None, :], t_out,
                     mask=(rm < M)[None, :])
        elif EPI_TMA:  # the last tile's second half may lie past M (M a multiple of HALF only)
            store_tile(acc, epi.index(c), out_desc, e * M + m0, n0, m0 < M)
        else:  # straight from registers: the loader fills the next tile's stages meanwhile
            rows = m0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, layout))
            cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
            gl.store(out_ptr + (e.to(gl.int64) * M + rows.to(gl.int64))[:, None] * stride_q + cols[None, :],
                     acc.to(gl.bfloat16), mask=(rows < M)[:, None])
    if EPI_TMA:
        tma.store_wait(0)


@gluon.jit
def _consume_second(p, STAGES: gl.constexpr, GATHER: gl.constexpr, EPI_TMA: gl.constexpr, TRANS_OUT: gl.constexpr):
    _consume(p, STAGES, GATHER, EPI_TMA, TRANS_OUT, 1)


@gluon.jit
def _wgrad_kernel(p_desc, q_desc, out_desc, offp_ptr, M, num_m, num_n, total, q_ptr, src_ptr, stride_q, out_ptr,
                  STAGES: gl.constexpr, GATHER: gl.constexpr, EPI_TMA: gl.constexpr, LW: gl.constexpr,
                  TRANS_OUT: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(p_desc.dtype, [2 * STAGES] + p_desc.block_type.shape, p_desc.layout)
    b_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    epi = gl.allocate_shared_memory(out_desc.dtype, [2 if EPI_TMA else 1] + out_desc.block_type.shape, out_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1 + GATHER * 32 * LW)  # the TMA's arrival, and each gathering thread's
        mbarrier.init(empty.index(s), count=2)  # both consumers
    p = (p_desc, q_desc, out_desc, a_bufs, b_bufs, epi, ready, empty, offp_ptr, M, num_m, num_n, total, q_ptr, src_ptr,
         stride_q, out_ptr)
    gl.warp_specialize([
        (_consume, (p, STAGES, GATHER, EPI_TMA, TRANS_OUT, 0)),
        (_consume_second, (p, STAGES, GATHER, EPI_TMA, TRANS_OUT)),
        (_loader, (p, STAGES, GATHER, EPI_TMA, LW)),
    ], [4, LW], ([200, 88] if LW == 4 else [200, 56]) if GATHER else [232, 40])


def _desc(t, block):
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def gluon_wgrad_coop(p, q, offp, E, sms, src=None, epi_tma=True, loader_warps=4, trans_out=False):
    """out [E, M, N] = P_e^T Q_e over each expert's rows [offp[e], offp[e + 1]). Without src, Q comes through TMA
    too, so each segment must start at a multiple of BK and hold whole BK steps (``pad``: zero rows). With src
    (int32 per row of P, -1 for a zero row), Q_e's rows are q[src], gathered and masked at the segment's end, so
    P can be the unpadded sorted tensor (what moe_fuse writes): the K step past an expert's end reads the next
    expert's P rows and multiplies them by zeros. M a multiple of 128. epi_tma: the epilogue through shared memory
    and a TMA store, 3 stages; else stored from registers, 4 stages. loader_warps (gathering only): 4, or 8 for
    twice the cp.async pieces in flight per stage (16 warps: the launch's 128 registers a thread, redistributed).
    trans_out: out [E, N, M] (Q_e^T P_e: dW_down in W_down's layout, P = aw and Q = dy), each tile read back
    transposed from its shared buffer (needs epi_tma's buffers) and stored along M."""
    M, N = p.shape[1], q.shape[1]
    if M % HALF or N % BN:
        raise ValueError(f"M={M} must be a multiple of {HALF} and N={N} of {BN}")
    if trans_out and not epi_tma:
        raise ValueError("trans_out goes through the epilogue's shared buffers: epi_tma must be on")
    out = torch.empty((E, N, M) if trans_out else (E, M, N), dtype=p.dtype, device=p.device)
    num_m, num_n = -(-M // (2 * HALF)), N // BN
    total = E * num_m * num_n
    gather = src is not None
    lw = loader_warps if gather else 4
    if lw not in (4, 8):
        raise ValueError(f"loader_warps must be 4 or 8, got {loader_warps}")
    q_desc = _desc(p[:, :BN] if gather else q, [BK, BN])  # unused when gathering: any descriptor of the block's type
    if q.stride(0) != N:
        raise ValueError("Q must be contiguous (its row stride is also the output's)")
    out_desc = _desc(out.view(-1, out.shape[-1]), [HALF, BN])  # unused with trans_out: any of the block's type
    _wgrad_kernel[(min(sms, total),)](_desc(p, [BK, HALF]), q_desc, out_desc, offp, M,
                                      num_m, num_n, total, q, src if gather else offp, N, out,
                                      STAGES if epi_tma else STAGES + 1, gather, epi_tma, lw, trans_out,
                                      num_warps=4, maxnreg=max_regs(lw))
    return out


def compile_sm90(gather: bool, epi_tma: bool, lw: int = 4, trans_out: bool = False):
    from triton.runtime.jit import mangle_type

    t = torch.empty(1024, 256, dtype=torch.bfloat16)
    sig = {"p_desc": mangle_type(_desc(t, [BK, HALF])), "q_desc": mangle_type(_desc(t, [BK, BN])),
           "out_desc": mangle_type(_desc(t, [HALF, BN])), "offp_ptr": "*i32", "M": "i32", "num_m": "i32",
           "num_n": "i32", "total": "i32", "q_ptr": "*bf16", "src_ptr": "*i32", "stride_q": "i32", "out_ptr": "*bf16",
           "STAGES": "constexpr", "GATHER": "constexpr", "EPI_TMA": "constexpr", "LW": "constexpr",
           "TRANS_OUT": "constexpr"}
    constants = {"STAGES": STAGES if epi_tma else STAGES + 1, "GATHER": gather, "EPI_TMA": epi_tma, "LW": lw,
                 "TRANS_OUT": trans_out}
    k, report = compile_sm90_report(_wgrad_kernel, sig, constants,
                                    ("offp_ptr", "M", "q_ptr", "src_ptr", "stride_q", "out_ptr"), maxnreg=max_regs(lw))
    regs = sorted({int(r) for r in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"])})
    print(f"GATHER={gather} EPI_TMA={epi_tma} LW={lw} TRANS_OUT={trans_out}: setmaxnreg.dec {regs}; "
          f"shared {k.metadata.shared} B; wgmma {'wgmma.mma_async' in k.asm['ptx']}; "
          f"TMA store {'cp.async.bulk.tensor.2d.global.shared' in k.asm['ptx']}\n{report}")


def main():
    args = probe_args()
    if args.compile:
        for g, lw in ((False, 4), (True, 4), (True, 8)):
            for t in (True, False):
                compile_sm90(g, t, lw)
        return [compile_sm90(True, True, lw, trans_out=True) for lw in (4, 8)]

    from probe_gluon_wgrad_gpu import check_then_time, gluon_wgrad, pad, wgrad_inputs

    from moe_fuse.kernels.permute import expand_rows

    w = wgrad_inputs(args.shape, args.tokens, BK)
    E, S, sms, routing, pos, offp, rows, src, cases = (w.E, w.S, w.sms, w.routing, w.pos, w.offp, w.rows, w.src,
                                                       w.cases)
    for name, (p, q, q_src, cutlass, transposed) in cases.items():
        flop = 2 * S * p.shape[1] * q.shape[1]
        pp, qp = pad(p, routing.offsets, offp, rows), pad(q, routing.offsets, offp, rows)
        want = cutlass()
        offs, tok = routing.offsets, routing.token  # the unpadded sorted layout: P as moe_fuse writes it
        ours = {"ping-pong, padded": lambda: gluon_wgrad(pp, qp, offp, E, sms),
                "ping-pong, gathered": lambda: gluon_wgrad(pp, q_src, offp, E, sms, src=src),
                "coop 256, padded": lambda: gluon_wgrad_coop(pp, qp, offp, E, sms),
                "coop 256, gathered": lambda: gluon_wgrad_coop(p, q_src, offs, E, sms, src=tok),
                "coop 256, gathered, 4 st": lambda: gluon_wgrad_coop(p, q_src, offs, E, sms, src=tok, epi_tma=False),
                "coop 256, gathered, 8 lw": lambda: gluon_wgrad_coop(p, q_src, offs, E, sms, src=tok, loader_warps=8),
                "coop 256, gathered, 4 st, 8 lw": lambda: gluon_wgrad_coop(p, q_src, offs, E, sms, src=tok,
                                                                           epi_tma=False, loader_warps=8)}
        if transposed:  # dW_down stored in W_down's layout, as the product would need it (a view back for the check)
            for lw in (4, 8):
                ours[f"coop 256, gathered, trans out, {lw} lw"] = lambda lw=lw: gluon_wgrad_coop(
                    p, q_src, offs, E, sms, src=tok, loader_warps=lw, trans_out=True).transpose(1, 2)
        check_then_time(name, ours, want, {"CUTLASS": cutlass, "expand + CUTLASS": lambda: (expand_rows(q_src, pos),
                                                                                           cutlass())},
                        args.seconds, flop, lambda out: out.transpose(1, 2) if transposed else out)


if __name__ == "__main__":
    main()
