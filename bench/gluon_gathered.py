"""Row-ragged GEMMs that gather their A rows (x[tok], dy[tok]) themselves, in Gluon (sm90).

out[p] = a[src[p]] @ B[e] for the rows p of each 128-row tile of moe_fuse's tile map (``ragged_gemm.tile_map``),
the product ``ragged_gemm`` computes on the sorted copy ``expand_rows`` writes. A cooperative 128 x 256 tile: one
loader partition gathers each stage's A tile [128 rows, 64] with cp.async (16 bytes a piece, every thread arriving
on the stage's barrier when its pieces land; rows past the tile's end gathered as zeros and not stored) and issues
the TMA loads of the weight tile's two halves; the two consumer warpgroups share the gathered A and each
multiplies its own 128 output columns, so a gathered byte feeds twice the MMAs of a 128 x 128 tile. Optionally
consumer 0 also stores the gathered A stages of a tile's first N tile to ``copy`` while its MMA runs: the sorted copy
as a by-product, for the weight gradients that still read it, without an expand pass and without a GEMM reading
the copy back.

Why it was written: at 30B T=16384 the layer step is energy-bound at the H200's 700 W cap, and the sorted copies xs
and dys were the step's largest byte cut left. Measured on the H200 (2026-12-05, bench/KERNELS_NOTES.md): bitwise
equal to CUTLASS, but a gathered GEMM costs about what expand + CUTLASS costs, and the step without copies took
+0.11 to +0.21 J. So it left moe_fuse for bench/, where the probes (probe_gluon_rows_coop_gpu.py,
probe_gathered_layer_gpu.py, probe_gluon_wgrad_coop_gpu.py's ``gather_stage``) keep that record reproducible.
CI compiles its launches for sm90 (tests/test_gluon_gathered.py).
"""

from __future__ import annotations

import torch

try:  # triton >= 3.5 ships Gluon; without it nothing here is used
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False

from moe_fuse.kernels.gluon_ragged import _desc
from moe_fuse.kernels.ragged_gemm import GPU_CONFIG, _sm_count

BM, HALF_N, BK = GPU_CONFIG.block_m, 128, 64  # a tile: the tile map's 128 rows x 2 x HALF_N columns
STAGES = 4  # a stage: A 16 KB + B 2 x 16 KB


if HAVE_GLUON:

    @gluon.jit
    def gather_stage(buf, bar, row_ptrs, row_ok, cols, n_cols):
        """One gathered stage: buf[i, j] = row_ptrs[i][cols[j]] by cp.async, zeros where not row_ok[i] or cols[j] >=
        n_cols; then this thread's arrival on bar, counted when its copies land (``mbarrier_arrive`` without
        increment: the barrier's count must include every thread of the gathering partition)."""
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        async_copy.async_copy_global_to_shared(buf, row_ptrs[:, None] + cols[None, :], mask=mask)
        async_copy.mbarrier_arrive(bar, increment_count=False)

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
                row_ptrs = x_ptr + src.to(gl.int64) * K
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
                    gather_stage(a_bufs.index(s), ready.index(s), row_ptrs, src >= 0, cols, K)
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
        copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [BLOCK_M, BLOCK_K]: 16 B
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
                            copy_at = copy_rows.to(gl.int64)[:, None] * K + (kk * BLOCK_K + copy_cols)[None, :]
                            gl.store(copy_ptr + copy_at, a_tile, mask=(copy_rows < r1)[:, None])
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


def runs_on(a: torch.Tensor) -> bool:
    """Gluon is installed and a is a bf16 CUDA tensor (callers check sm90)."""
    return HAVE_GLUON and a.is_cuda and a.dtype == torch.bfloat16


def suits(N: int, K: int) -> bool:
    """Whole 256-column tiles and 64-element K steps."""
    return N % (2 * HALF_N) == 0 and K % BK == 0


def max_regs(loader_warps: int) -> int:
    """The launch's registers a thread: 65536 over the kernel's 12 or 16 warps (the partitions then move them)."""
    return 168 if loader_warps == 4 else 128


def rows_gemm(a, w, tiles, rows: int, *, src=None, b_kmajor: bool = True, loader_warps: int = 4, copy=None):
    """out [rows, N] = A[r] @ B_e for the rows r of each tile of ``tiles`` (``ragged_gemm.tile_map`` with 128-row
    tiles). A = a[src] gathered (src int32, one per row; rows past a tile's end are zeros and not stored), or
    without src a itself through TMA (a sorted copy whose tiles are whole). B_e = w[e]^T for w [E, N, K]
    (b_kmajor: W_gate_up) or w[e] for w [E, K, N] (W_down); w contiguous. loader_warps (gathering): 4, or 8 for
    twice the cp.async pieces in flight a stage. copy (gathering): a contiguous [rows, K] tensor that receives
    a[src] (the sorted copy) as a by-product."""
    if not (HAVE_GLUON and a.is_cuda and a.dtype == w.dtype == torch.bfloat16 and a.is_contiguous()
            and w.is_contiguous()):
        raise ValueError("gluon_gathered.rows_gemm: needs Gluon and contiguous bf16 CUDA operands")
    if b_kmajor:
        E, N, K = w.shape
        w_desc = _desc(w.view(E * N, K), [HALF_N, BK])
    else:
        E, K, N = w.shape
        w_desc = _desc(w.view(E * K, N), [BK, HALF_N])
    if not suits(N, K) or a.shape[1] != K:
        raise ValueError(f"gluon_gathered.rows_gemm: N={N} must be a multiple of {2 * HALF_N}, K={K} of {BK} and "
                         f"a's columns ({a.shape[1]})")
    gather = src is not None
    lw = loader_warps if gather else 4
    if lw not in (4, 8):
        raise ValueError(f"gluon_gathered.rows_gemm: loader_warps must be 4 or 8, got {loader_warps}")
    if copy is not None and (not gather or tuple(copy.shape) != (rows, K) or not copy.is_contiguous()
                             or copy.dtype != a.dtype):
        raise ValueError(f"gluon_gathered.rows_gemm: copy must be a contiguous [{rows}, {K}] {a.dtype} tensor, "
                         "with src (gathering)")
    out = torch.empty(rows, N, dtype=a.dtype, device=a.device)
    num_n = N // (2 * HALF_N)
    bound = (tiles.numel() - 1) // 3  # the map's room: at least its tile count, which is on the device
    a_desc = _desc(w.view(-1, w.shape[-1]) if gather else a, [BM, BK])  # unused when gathering: any of its type
    _rows_kernel[(min(_sm_count(a.device), bound * num_n),)](
        a_desc, w_desc, tiles, num_n, N, K, a, src if gather else tiles, out, out if copy is None else copy,
        STAGES, gather, b_kmajor, lw, copy is not None, num_warps=4, maxnreg=max_regs(lw))
    return out


# (GATHER, B_KMAJOR, LW, WRITE_A) of every launch: through TMA or gathered, either weight layout, 4 or 8 loader
# warps, with and without the copy
LAUNCHES = tuple((g, km, lw, wa) for km in (True, False)
                 for g, lw, wa in ((False, 4, False), (True, 4, False), (True, 8, False), (True, 4, True),
                                   (True, 8, True)))


def compile_sm90(gather: bool, b_kmajor: bool, lw: int, write_a: bool):
    """Compile one launch's kernel for sm90 without a GPU (triton.compile): the CPU-side check of this module."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    t = torch.empty(1024, 256, dtype=torch.bfloat16)
    sig = {"a_desc": mangle_type(_desc(t, [BM, BK])),
           "w_desc": mangle_type(_desc(t, [HALF_N, BK] if b_kmajor else [BK, HALF_N])), "tiles_ptr": "*i32",
           "num_n": "i32", "N": "i32", "K": "i32", "x_ptr": "*bf16", "src_ptr": "*i32", "out_ptr": "*bf16",
           "copy_ptr": "*bf16"}
    consts = {"STAGES": STAGES, "GATHER": gather, "B_KMAJOR": b_kmajor, "LW": lw, "WRITE_A": write_a}
    sig.update({name: "constexpr" for name in consts})
    # what the runtime's specialization says of 16-byte aligned pointers and multiples of 16
    attrs = {(list(sig).index(n),): [["tt.divisibility", 16]]
             for n in ("tiles_ptr", "N", "K", "x_ptr", "src_ptr", "out_ptr", "copy_ptr")}
    return triton.compile(GluonASTSource(_rows_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": max_regs(lw)})


__all__ = ["HAVE_GLUON", "LAUNCHES", "compile_sm90", "gather_stage", "max_regs", "rows_gemm", "runs_on", "suits"]
