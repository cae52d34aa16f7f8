"""The experts' weight gradients, out[e] = P_e^T Q_e over each expert's sorted rows, in Gluon (sm90).

What ``torch._grouped_mm(p.t(), q, offs=ends)`` computes for dW_gate_up (P = d_h, Q = xs) and dW_down (P = dys,
Q = aw): a K-ragged grouped GEMM whose K is each expert's row count. A persistent program walks (expert, 256-row
M tile, 128-column N tile); one load warp brings each 64-row K step of P's two 128-column halves and of Q into a
ring of shared-memory stages by TMA, and two consumer warpgroups share the Q tile, each multiplying its own half
of P (a cooperative 256 x 128 tile: half the shared-memory and L2 bytes per FLOP of a 128 x 128 one). Each
consumer writes its bf16 tile to a shared buffer and hands it to a TMA store.

Experts' rows are not padded: the K steps of expert e start at its first row, and its last step may run into the
next expert's rows, into sentinel rows past offsets[E] that nobody wrote (any bits, NaN included), or past the
tensor (TMA reads zeros). Before that step's MMA each consumer zeroes those rows in its P half and in its half of
the shared Q tile's rows, and the two meet at an mbarrier: the step adds exact zeros, at the positions where
CUTLASS's per-group bounds put them, so the sums keep its order and bits.

Why: at 30B T=16384 the layer step is energy-bound at the 700 W cap, and the probe of this tile on padded copies
(bench/probe_gluon_wgrad_coop_gpu.py, 2026-12-05) ran both weight gradients bitwise equal to CUTLASS in fewer
joules (dW_gate_up 999 vs 1053 mJ, dW_down 527 vs 562). Gluon has no interpreter: CI compiles the kernel for
sm90 (tests/test_gluon_wgrad.py); ``torch._grouped_mm`` is its CPU twin.
"""

from __future__ import annotations

import torch

try:  # triton >= 3.5 ships Gluon; without it nothing here is used
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False

from .gluon_ragged import _desc
from .ragged_gemm import _sm_count

HALF, BN, BK = 128, 128, 64  # a tile: 2 x HALF of P's columns (one half per consumer) x BN of Q's; 64-row K steps
STAGES = 3  # a stage: P 2 x 16 KB + Q 16 KB; with the two 32 KB epilogue buffers 208 KB of shared memory


if HAVE_GLUON:

    @gluon.jit
    def tile_of(t, off_ptr, num_n, per_e, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Tile t of the persistent walk over (expert, 2 x HALF_M output rows, BLOCK_N output columns): the expert
        e, the tile's first row m0 and column n0, and the expert's rows [lo, hi)."""
        e = t // per_e
        return (e, (t % per_e) // num_n * (2 * HALF_M), (t % num_n) * BLOCK_N, gl.load(off_ptr + e),
                gl.load(off_ptr + e + 1))

    @gluon.jit
    def store_tile(acc, buf, out_desc, row, col, in_range):
        """A consumer's tile in bf16 through its shared buffer and a TMA store, after the buffer's store before has
        read it. The caller waits for the last store (``tma.store_wait(0)``) before it exits."""
        tma.store_wait(0)
        gl.thread_barrier()
        buf.store(acc.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        if in_range:
            tma.async_copy_shared_to_global(out_desc, [row, col], buf)

    @gluon.jit
    def _zero_rows_from(buf, row0, hi, layout: gl.constexpr):
        """Zero the rows of a [rows, cols] shared buffer whose global row (row0 + i) is at or past hi."""
        rk = row0 + gl.arange(0, buf.shape[0], layout=gl.SliceLayout(1, layout))
        tile = buf.load(layout)
        buf.store(gl.where((rk < hi)[:, None], tile, gl.zeros_like(tile)))

    @gluon.jit
    def _loader(p, STAGES: gl.constexpr):
        """Each K step: P's two halves and Q's tile by TMA, from the expert's first row on."""
        p_desc, q_desc, out_desc, a_bufs, b_bufs, epi, ready, empty, zeroed, off_ptr, M, num_m, num_n, total = p
        BLOCK_K: gl.constexpr = p_desc.block_type.shape[0]
        HALF_M: gl.constexpr = p_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = q_desc.block_type.shape[1]
        per_e = num_m * num_n
        it = 0
        for t in range(gl.program_id(0), total, gl.num_programs(0)):
            e, m0, n0, lo, hi = tile_of(t, off_ptr, num_n, per_e, HALF_M, BLOCK_N)
            for r0 in range(lo, hi, BLOCK_K):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), 2 * p_desc.block_type.nbytes + q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(p_desc, [r0, m0], ready.index(s), a_bufs.index(2 * s))
                tma.async_copy_global_to_shared(p_desc, [r0, m0 + HALF_M], ready.index(s), a_bufs.index(2 * s + 1))
                tma.async_copy_global_to_shared(q_desc, [r0, n0], ready.index(s), b_bufs.index(s))
                it += 1

    @gluon.jit
    def _consume(p, STAGES: gl.constexpr, c: gl.constexpr):
        """Consumer c: P's columns [m0 + c * HALF, m0 + (c + 1) * HALF) of every tile."""
        p_desc, q_desc, out_desc, a_bufs, b_bufs, epi, ready, empty, zeroed, off_ptr, M, num_m, num_n, total = p
        BLOCK_K: gl.constexpr = p_desc.block_type.shape[0]
        HALF_M: gl.constexpr = p_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = q_desc.block_type.shape[1]
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
        rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # a P half [BLOCK_K, HALF_M]
        per_e = num_m * num_n
        it = 0
        n_zeroed = 0  # overhanging steps so far: the phase of ``zeroed`` (both consumers walk the same steps)
        for t in range(gl.program_id(0), total, gl.num_programs(0)):
            e, m0, n0, lo, hi = tile_of(t, off_ptr, num_n, per_e, HALF_M, BLOCK_N)
            m0 += c * HALF_M
            n_k = gl.cdiv(hi - lo, BLOCK_K)
            acc = gl.zeros((HALF_M, BLOCK_N), dtype=gl.float32, layout=layout)
            for kk in range(n_k):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                a = a_bufs.index(2 * s + c)
                b = b_bufs.index(s)
                if lo + (kk + 1) * BLOCK_K > hi:  # the expert's last step runs past its rows: zero them
                    r0 = lo + kk * BLOCK_K
                    _zero_rows_from(a, r0, hi, rows_layout)  # this consumer's P half
                    _zero_rows_from(b.slice(c * (BLOCK_K // 2), BLOCK_K // 2), r0 + c * (BLOCK_K // 2), hi,
                                    rows_layout)  # its half of the shared Q tile's rows
                    fence_async_shared()  # written through the generic proxy; wgmma reads through the async one
                    gl.thread_barrier()  # the whole warpgroup's rows, before it says so
                    mbarrier.arrive(zeroed, count=1)  # and both halves of Q before either MMA reads them
                    mbarrier.wait(zeroed, n_zeroed & 1)
                    n_zeroed += 1
                acc = warpgroup_mma(a.permute((1, 0)), b, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=kk > 0)
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=n_k > 0)
            # the last M tile's second half lies past M when M is an odd multiple of HALF
            store_tile(acc, epi.index(c), out_desc, e * M + m0, n0, m0 < M)
        tma.store_wait(0)

    @gluon.jit
    def _consume_second(p, STAGES: gl.constexpr):
        _consume(p, STAGES, 1)

    @gluon.jit
    def _wgrad_kernel(p_desc, q_desc, out_desc, off_ptr, M, num_m, num_n, total, STAGES: gl.constexpr):
        a_bufs = gl.allocate_shared_memory(p_desc.dtype, [2 * STAGES] + p_desc.block_type.shape, p_desc.layout)
        b_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        epi = gl.allocate_shared_memory(out_desc.dtype, [2] + out_desc.block_type.shape, out_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        zeroed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)  # the TMA's arrival
            mbarrier.init(empty.index(s), count=2)  # both consumers
        mbarrier.init(zeroed, count=2)  # both consumers have zeroed their rows of an overhanging step
        p = (p_desc, q_desc, out_desc, a_bufs, b_bufs, epi, ready, empty, zeroed, off_ptr, M, num_m, num_n, total)
        gl.warp_specialize([
            (_consume, (p, STAGES, 0)),
            (_consume_second, (p, STAGES)),
            (_loader, (p, STAGES)),
        ], [4, 4], [232, 40])


MAX_REGS = 168  # the launch's registers a thread (65536 over 12 warps); the partitions move them to 232 / 232 / 40


def runs_on(p: torch.Tensor, q: torch.Tensor) -> bool:
    """Gluon is installed, both operands are contiguous bf16 CUDA tensors that suit the tile: P's columns a
    multiple of 128, Q's of 128 (callers have checked sm90)."""
    return (HAVE_GLUON and p.is_cuda and p.dtype == q.dtype == torch.bfloat16 and p.is_contiguous()
            and q.is_contiguous() and p.shape[1] % HALF == 0 and q.shape[1] % BN == 0)


def wgrad(p: torch.Tensor, q: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """out [E, M, N] bf16 with out[e] = p[r]^T q[r] over the rows r in [offsets[e], offsets[e + 1]) (fp32
    accumulation; zeros for an expert without rows). p [S, M], q [S, N] contiguous bf16 CUDA tensors, M and N
    multiples of 128; offsets int32 [E + 1] on the device, offsets[0] = 0 and offsets[E] <= S."""
    if not runs_on(p, q) or p.shape[0] != q.shape[0]:
        raise ValueError(f"gluon_wgrad.wgrad: needs Gluon and contiguous bf16 CUDA operands with the same rows, "
                         f"P's and Q's columns multiples of {HALF} and {BN}; got p {tuple(p.shape)} {p.dtype}, "
                         f"q {tuple(q.shape)} {q.dtype}")
    if offsets.dtype != torch.int32 or offsets.dim() != 1 or offsets.device != p.device:
        raise ValueError(f"gluon_wgrad.wgrad: offsets must be a 1-D int32 tensor on {p.device}, got "
                         f"{offsets.dtype} {tuple(offsets.shape)} on {offsets.device}")
    E, (M, N) = offsets.numel() - 1, (p.shape[1], q.shape[1])
    out = torch.empty(E, M, N, dtype=p.dtype, device=p.device)
    num_m, num_n = -(-M // (2 * HALF)), N // BN
    total = E * num_m * num_n
    if p.shape[0] == 0:  # no rows at all (TMA descriptors need some): every expert's gradient is zero
        return out.zero_()
    if total:
        _wgrad_kernel[(min(_sm_count(p.device), total),)](
            _desc(p, [BK, HALF]), _desc(q, [BK, BN]), _desc(out.view(E * M, N), [HALF, BN]), offsets, M, num_m,
            num_n, total, STAGES, num_warps=4, maxnreg=MAX_REGS)
    return out


LAUNCHES = ((),)  # one launch: no variants


def compile_sm90():
    """Compile the kernel for sm90 without a GPU (triton.compile): the CPU-side check of this module."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    t = torch.empty(1024, 256, dtype=torch.bfloat16)
    sig = {"p_desc": mangle_type(_desc(t, [BK, HALF])), "q_desc": mangle_type(_desc(t, [BK, BN])),
           "out_desc": mangle_type(_desc(t, [HALF, BN])), "off_ptr": "*i32", "M": "i32", "num_m": "i32",
           "num_n": "i32", "total": "i32", "STAGES": "constexpr"}
    # what the runtime's specialization says of a 16-byte aligned pointer and a multiple of 16
    attrs = {(list(sig).index(n),): [["tt.divisibility", 16]] for n in ("off_ptr", "M")}
    return triton.compile(GluonASTSource(_wgrad_kernel, sig, {"STAGES": STAGES}, attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": MAX_REGS})


__all__ = ["HAVE_GLUON", "LAUNCHES", "compile_sm90", "runs_on", "store_tile", "tile_of", "wgrad"]
