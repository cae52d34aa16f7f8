#!/usr/bin/env python3
"""Probe: the row-ragged gate_up and dgrad GEMMs with their A rows gathered (x[token], dy[token]) on cooperative
128 x 256 tiles.

    PYTHONPATH=. python3 bench/probe_gluon_rows_coop_gpu.py [--shape 30b] [--tokens 16384] [--seconds 2]
    PYTHONPATH=. python3 bench/probe_gluon_rows_coop_gpu.py --compile      # CPU: compile for sm90, ptxas -v

The other half of dropping the sorted copy xs (bench/KERNELS_NOTES.md, "the step's bytes read off the
counters"): besides dW_gate_up (bench/probe_gluon_wgrad_coop_gpu.py), the forward's gate_up GEMM reads xs, and
would have to gather x's rows itself. With Triton's pointer loads that was 5-8% slower (fourteenth session).
Here, in Gluon: a 4-warp loader gathers the stage's A tile [128 rows, 64] with cp.async (each thread 8 16-byte
pieces, arriving on the stage's barrier when they land) and issues the TMA loads of the weight tile's two halves
([128, 64] each); the two consumer warpgroups share the gathered A and each multiplies its own 128 output columns,
so the gathered bytes per FLOP are half those of a 128 x 128 tile (and with 8 loader warps, half the pieces a
thread). Epilogue from registers (32 K steps a tile at
H = 2048, so it weighs little).

Tiles: 128 rows of one expert each, from moe_fuse's tile map (``ragged_gemm.tile_map``, built on the device).
The gathered variant runs on the unpadded sorted layout moe_fuse writes (rows past a tile's end gathered as
zeros, not stored); the TMA variant reads a copy with each expert's rows padded to whole tiles (``pad``), its
padding rows dropped before comparing.
dgrad (dys @ W_down[e], W_down [E, H, I]: the weight tile's halves are column blocks, wgmma's B read N-major) is
the same kernel with ``b_kmajor=False``: with the weight-gradient probe's dW_down it sizes the readers of dys.
A third variant writes the sorted copy as a by-product (``copy``: consumer 0 stores each gathered stage of a tile's
first N tile while its MMA runs), for a step that keeps the copies for the weight gradients but drops the expand
passes and the GEMMs' reads of the copies: "gathered + copy" against "expand + CUTLASS" sizes that.
Prints, per GEMM, the error against CUTLASS on the sorted copy and bitwise equality, then at the power cap ms and
NVML mJ per call of CUTLASS, expand + CUTLASS, and both variants.
"""

from __future__ import annotations

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
from probe_gluon_wgrad_coop_gpu import max_regs  # noqa: E402
from probe_gluon_wgrad_gpu import compile_sm90_report, probe_args  # noqa: E402

BM, HALF_N, BK = 128, 128, 64  # a tile: BM rows x 2 x HALF_N columns (one half per consumer)
STAGES = 4  # a stage: A 16 KB + B 2 x 16 KB


@gluon.jit
def _loader(p, STAGES: gl.constexpr, GATHER: gl.constexpr, B_KMAJOR: gl.constexpr, LW: gl.constexpr):
    """Each stage: the weight tile's two halves by TMA (row blocks of w [E, N, K], or with B_KMAJOR off column
    blocks of w [E, K, N]); A by TMA of the padded sorted copy, or (GATHER) its rows x[src] gathered through
    cp.async by this LW-warp partition, every thread arriving when its pieces land."""
    a_desc, w_desc, a_bufs, b_bufs, ready, empty, tiles_ptr, num_n, N, K, x_ptr, src_ptr, out_ptr, copy_ptr = p
    total = gl.load(tiles_ptr) * num_n  # the tile map's M tiles (on the device) x N tiles
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    HALF: gl.constexpr = w_desc.block_type.shape[0] if B_KMAJOR else w_desc.block_type.shape[1]
    gather: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LW, 1], [1, 0])  # 16-byte pieces, a row's in 8 threads
    it = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        m_tile = t // num_n
        e = gl.load(tiles_ptr + 1 + 3 * m_tile)
        r0 = gl.load(tiles_ptr + 2 + 3 * m_tile)
        r1 = gl.load(tiles_ptr + 3 + 3 * m_tile)
        n0 = (t % num_n) * (2 * HALF)
        if GATHER:
            rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, gather))
            src = gl.load(src_ptr + r0 + rm, mask=r0 + rm < r1, other=-1)  # -1: a zero row (past the expert)
            rows64 = src.to(gl.int64)[:, None] * K
        for k0 in range(0, K, BLOCK_K):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            if GATHER:
                mbarrier.expect(ready.index(s), 2 * w_desc.block_type.nbytes)
            else:
                mbarrier.expect(ready.index(s), 2 * w_desc.block_type.nbytes + a_desc.block_type.nbytes)
            if B_KMAJOR:
                tma.async_copy_global_to_shared(w_desc, [e * N + n0, k0], ready.index(s), b_bufs.index(2 * s))
                tma.async_copy_global_to_shared(w_desc, [e * N + n0 + HALF, k0], ready.index(s),
                                                b_bufs.index(2 * s + 1))
            else:
                tma.async_copy_global_to_shared(w_desc, [e * K + k0, n0], ready.index(s), b_bufs.index(2 * s))
                tma.async_copy_global_to_shared(w_desc, [e * K + k0, n0 + HALF], ready.index(s),
                                                b_bufs.index(2 * s + 1))
            if GATHER:
                cols = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, gather))
                mask = (src >= 0)[:, None] & (cols < K)[None, :]
                async_copy.async_copy_global_to_shared(a_bufs.index(s), x_ptr + rows64 + cols[None, :], mask=mask)
                async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
            else:
                tma.async_copy_global_to_shared(a_desc, [r0, k0], ready.index(s), a_bufs.index(s))
            it += 1


@gluon.jit
def _consume(p, STAGES: gl.constexpr, GATHER: gl.constexpr, B_KMAJOR: gl.constexpr, WRITE_A: gl.constexpr,
             c: gl.constexpr):
    """Consumer c: output columns [n0 + c * HALF, n0 + (c + 1) * HALF) of every tile. WRITE_A: consumer 0 also
    stores each gathered A stage of a tile's first N tile to copy (the sorted copy, as a by-product)."""
    a_desc, w_desc, a_bufs, b_bufs, ready, empty, tiles_ptr, num_n, N, K, x_ptr, src_ptr, out_ptr, copy_ptr = p
    total = gl.load(tiles_ptr) * num_n  # the tile map's M tiles (on the device) x N tiles
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    HALF: gl.constexpr = w_desc.block_type.shape[0] if B_KMAJOR else w_desc.block_type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, HALF, 16])
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [BLOCK_M, BLOCK_K], 16 B a thread
    n_k = gl.cdiv(K, BLOCK_K)
    it = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        r0 = gl.load(tiles_ptr + 2 + 3 * (t // num_n))
        r1 = gl.load(tiles_ptr + 3 + 3 * (t // num_n))
        n0 = (t % num_n) * (2 * HALF) + c * HALF
        acc = gl.zeros((BLOCK_M, HALF), dtype=gl.float32, layout=layout)
        if WRITE_A:
            copy_rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, copy_layout))
            copy_cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, copy_layout))
            copy_here = (t % num_n) == 0
        for kk in range(n_k):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            if GATHER:  # cp.async wrote A through the generic proxy; wgmma reads through the async one
                fence_async_shared()
            if B_KMAJOR:  # a [HALF, BLOCK_K] tile of w [E, N, K]: wgmma's B is its transpose
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(2 * s + c).permute((1, 0)), acc, is_async=True)
            else:  # already [BLOCK_K, HALF]
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(2 * s + c), acc, is_async=True)
            if WRITE_A:  # while the MMA runs: the stage is held until this consumer frees it, a step later
                if c == 0:
                    if copy_here:
                        a_tile = a_bufs.index(s).load(copy_layout)
                        gl.store(copy_ptr + copy_rows.to(gl.int64)[:, None] * K + (kk * BLOCK_K + copy_cols)[None, :],
                                 a_tile, mask=(copy_rows < r1)[:, None])
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=kk > 0)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
        rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        cols = n0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
        gl.store(out_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :], acc.to(gl.bfloat16),
                 mask=(rows < r1)[:, None] & (cols < N)[None, :])


@gluon.jit
def _consume_second(p, STAGES: gl.constexpr, GATHER: gl.constexpr, B_KMAJOR: gl.constexpr, WRITE_A: gl.constexpr):
    _consume(p, STAGES, GATHER, B_KMAJOR, WRITE_A, 1)


@gluon.jit
def _rows_kernel(a_desc, w_desc, tiles_ptr, num_n, N, K, x_ptr, src_ptr, out_ptr, copy_ptr,
                 STAGES: gl.constexpr, GATHER: gl.constexpr, B_KMAJOR: gl.constexpr, LW: gl.constexpr,
                 WRITE_A: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [2 * STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1 + GATHER * 32 * LW)  # the TMA's arrival, and each gathering thread's
        mbarrier.init(empty.index(s), count=2)  # both consumers
    p = (a_desc, w_desc, a_bufs, b_bufs, ready, empty, tiles_ptr, num_n, N, K, x_ptr, src_ptr, out_ptr, copy_ptr)
    gl.warp_specialize([
        (_consume, (p, STAGES, GATHER, B_KMAJOR, WRITE_A, 0)),
        (_consume_second, (p, STAGES, GATHER, B_KMAJOR, WRITE_A)),
        (_loader, (p, STAGES, GATHER, B_KMAJOR, LW)),
    ], [4, LW], ([200, 88] if LW == 4 else [200, 56]) if GATHER else [232, 40])


def _desc(t, block):
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def gluon_rows_coop(a, w, tiles, rows, sms, src=None, b_kmajor=True, loader_warps=4, copy=None):
    """out [rows, N] = A[r] @ B_e for the rows r of each tile of ``tiles`` (moe_fuse's ``ragged_gemm.tile_map``
    with 128-row tiles: the tile count, then expert, first row, end row per tile, on the device); A = a (through
    TMA, so every tile must be whole: rows padded per expert), or with src (int32 per row) the gathered a[src],
    masked past each tile's end row: the unpadded sorted layout moe_fuse writes. B_e = w[e]^T for w [E, N, K]
    (b_kmajor: gate_up's W_gate_up) or w[e] for w [E, K, N] (dgrad's W_down); w contiguous, N a multiple of 256.
    loader_warps (gathering only): 4, or 8 for twice the cp.async pieces in flight per stage (``max_regs``).
    copy (gathering only): a [rows, K] tensor that receives the gathered rows (the sorted copy a[src]) as a
    by-product, for the weight gradient that still reads it."""
    if b_kmajor:
        E, N, K = w.shape
        w_desc = _desc(w.view(E * N, K), [HALF_N, BK])
    else:
        E, K, N = w.shape
        w_desc = _desc(w.view(E * K, N), [BK, HALF_N])
    if N % (2 * HALF_N) or K % BK:
        raise ValueError(f"N={N} must be a multiple of {2 * HALF_N} and K={K} of {BK}")
    out = torch.empty(rows, N, dtype=a.dtype, device=a.device)
    num_n = N // (2 * HALF_N)
    bound = (tiles.numel() - 1) // 3  # the map's room: at least its tile count
    gather = src is not None
    lw = loader_warps if gather else 4
    if lw not in (4, 8):
        raise ValueError(f"loader_warps must be 4 or 8, got {loader_warps}")
    if copy is not None and (not gather or tuple(copy.shape) != (rows, K) or not copy.is_contiguous()):
        raise ValueError(f"copy: a contiguous [{rows}, {K}] tensor, with src (gathering)")
    a_desc = _desc(w.view(-1, w.shape[-1]) if gather else a, [BM, BK])  # unused when gathering: any of its type
    _rows_kernel[(min(sms, bound * num_n),)](a_desc, w_desc, tiles, num_n, N, K, a, src if gather else tiles, out,
                                            out if copy is None else copy, STAGES, gather, b_kmajor, lw,
                                            copy is not None, num_warps=4, maxnreg=max_regs(lw))
    return out


def compile_sm90(gather: bool, b_kmajor: bool, lw: int = 4, write_a: bool = False):
    from triton.runtime.jit import mangle_type

    t = torch.empty(1024, 256, dtype=torch.bfloat16)
    w_block = [HALF_N, BK] if b_kmajor else [BK, HALF_N]
    sig = {"a_desc": mangle_type(_desc(t, [BM, BK])), "w_desc": mangle_type(_desc(t, w_block)),
           "tiles_ptr": "*i32", "num_n": "i32", "N": "i32", "K": "i32", "x_ptr": "*bf16",
           "src_ptr": "*i32", "out_ptr": "*bf16", "copy_ptr": "*bf16", "STAGES": "constexpr", "GATHER": "constexpr",
           "B_KMAJOR": "constexpr", "LW": "constexpr", "WRITE_A": "constexpr"}
    k, report = compile_sm90_report(
        _rows_kernel, sig, {"STAGES": STAGES, "GATHER": gather, "B_KMAJOR": b_kmajor, "LW": lw, "WRITE_A": write_a},
        ("tiles_ptr", "N", "K", "x_ptr", "src_ptr", "out_ptr", "copy_ptr"), maxnreg=max_regs(lw))
    print(f"GATHER={gather} B_KMAJOR={b_kmajor} LW={lw} WRITE_A={write_a}: shared {k.metadata.shared} B; "
          f"wgmma {'wgmma.mma_async' in k.asm['ptx']}\n{report}")


def main():
    args = probe_args()
    if args.compile:
        for km in (True, False):
            for g, lw in ((False, 4), (True, 4), (True, 8)):
                compile_sm90(g, km, lw)
        return [compile_sm90(True, km, lw, write_a=True) for km in (True, False) for lw in (4, 8)]

    from probe_gather_wgrad_gpu import routed_inputs
    from probe_gluon_wgrad_gpu import check_then_time, pad, padded_offsets, report_check

    from moe_fuse.kernels.permute import expand_rows
    from moe_fuse.kernels.ragged_gemm import GPU_CONFIG, tile_map

    assert GPU_CONFIG.block_m == BM

    H, I, E, k = SHAPES[args.shape]
    T, S, dev = args.tokens, args.tokens * k, "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x, dy, _, _, routing = routed_inputs(H, I, E, k, T, dev)  # the other probes' inputs, the same draws
    gen = torch.Generator(device=dev).manual_seed(1)
    w_gate_up = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H**-0.5).to(torch.bfloat16)
    w_down = (torch.randn(E, H, I, device=dev, generator=gen) * H**-0.5).to(torch.bfloat16)
    ends = routing.offsets[1:]
    pos = routing.pos.view(T, k)
    offp, rows_p = padded_offsets(routing, BM, f"{args.shape} T={T}")
    keep = pad(torch.ones(S, 1, device=dev), routing.offsets, offp, rows_p).view(-1).bool()  # padding rows: False
    tiles_p, tiles = tile_map(offp, rows_p), tile_map(routing.offsets, S)  # GPU_CONFIG's 128-row tiles = BM
    # the two readers of a sorted copy along M: gate_up (xs, W_gate_up [E, 2I, H]) and dgrad (dys, W_down [E, H, I])
    cases = {"gate_up": (x, w_gate_up, True, lambda a_s: torch._grouped_mm(a_s, w_gate_up.transpose(1, 2), offs=ends)),
             "dgrad": (dy, w_down, False, lambda a_s: torch._grouped_mm(a_s, w_down, offs=ends))}
    for name, (a, w, kmajor, grouped_mm) in cases.items():
        a_s = expand_rows(a, pos)  # the sorted copy moe_fuse writes today
        a_p = pad(a_s, routing.offsets, offp, rows_p)  # the TMA variant's whole tiles
        flop = 2 * S * w.shape[1] * w.shape[2]
        want = grouped_mm(a_s)
        # the padded variant's output holds padding rows: compared through `keep`, outside its timed call
        padded = gluon_rows_coop(a_p, w, tiles_p, rows_p, sms, b_kmajor=kmajor)
        torch.cuda.synchronize()
        report_check(f"{name:10s} {'coop 128x256, padded':22s}", padded[keep], want)
        del padded
        gathered = {f"coop 128x256, gathered, {lw} lw": lambda lw=lw: gluon_rows_coop(
            a, w, tiles, S, sms, src=routing.token, b_kmajor=kmajor, loader_warps=lw) for lw in (4, 8)}
        # the by-product: the sorted copy written by the GEMM that gathers it (the weight gradients still read it)
        for lw in (4, 8):
            copy = torch.full_like(a_s, float("nan"))
            gluon_rows_coop(a, w, tiles, S, sms, src=routing.token, b_kmajor=kmajor, loader_warps=lw, copy=copy)
            torch.cuda.synchronize()
            print(f"  {name:10s} the copy written by the gathering GEMM ({lw} lw) bitwise expand_rows': "
                  f"{torch.equal(copy, a_s)}", flush=True)
            gathered[f"coop 128x256, gathered + copy, {lw} lw"] = lambda lw=lw: gluon_rows_coop(
                a, w, tiles, S, sms, src=routing.token, b_kmajor=kmajor, loader_warps=lw, copy=torch.empty_like(a_s))
        del copy
        baselines = {"CUTLASS": lambda: grouped_mm(a_s), "expand + CUTLASS": lambda: grouped_mm(expand_rows(a, pos)),
                     "coop 128x256, padded": lambda: gluon_rows_coop(a_p, w, tiles_p, rows_p, sms, b_kmajor=kmajor)}
        check_then_time(name, gathered, want, baselines, args.seconds, flop, what=" of the routed rows")
        del a_s, a_p


if __name__ == "__main__":
    main()
