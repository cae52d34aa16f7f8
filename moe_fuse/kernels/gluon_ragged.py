"""Warp-specialized row-ragged GEMMs in Gluon (sm90), optionally with the SwiGLU / dSwiGLU passes in their epilogues.

The same products as ``ragged_gemm`` (one tile map, 128-row steps per expert), written in Gluon
(``triton.experimental.gluon``) so that the partitions are explicit, as in CUTLASS's ping-pong kernel:
one load warp issues the TMA loads of A and B into a ring of shared-memory stages, running ahead across
tiles, and two consumer warpgroups take alternate 128 x 128 tiles of a persistent program, their K loops
in turn, so one writes its tile while the other multiplies. triton 3.6's automatic warp specialization
hung on the H200 (bench/KERNELS_NOTES.md); these explicit partitions run.

Epilogues (``EPI``):

- 0, plain: out[p] = a[p] @ B[e].
- 1, gate_up + SwiGLU: a tile's B holds 64 gate rows and the up rows of the same 64 units of
  W_gate_up[e], so its accumulator splits into gate and up in registers; h is stored, and
  aw = w * silu(gate) * up from the stored (rounded) h: the SwiGLU pass's bits, without reading h back.
- 2, dgrad + dSwiGLU: g = dy_s[p] @ W_down[e] rounded to bf16 as the unfused GEMM stores it; d_h from
  g, the kept h and w, as backward.py's dSwiGLU pass; d_weights = sum_i g * silu(gate) * up as one fp32
  partial per (N tile, row), summed in N order afterwards (deterministic; not the unfused pass's
  bits, whose row sum runs in 256-column chunks of another reduction tree).

Measured on the H200 (bench/check_gluon_ragged_gpu.py, bench/KERNELS_NOTES.md): bitwise equal to the
Triton kernels; alone, 3-7% faster than ``ragged_gemm`` on three of the four 30B GEMMs, and the fused
gate_up 0.09 ms under GEMM + pass; but the 30B layer step, energy-bound at the 700 W cap, ran no faster
with either. So ``grouped_mm_path`` leaves them off (``GLUON``, ``GLUON_SWIGLU``, ``GLUON_DSWIGLU``: A/B
switches).

Gluon has no interpreter, so CI only compiles these kernels for sm90 (tests/test_gluon_ragged.py); the
Triton kernels they stand in for (``ragged_gemm``, ``swiglu``, ``dswiglu``) are their tested CPU twin.
"""

from __future__ import annotations

import torch

try:  # triton >= 3.5 ships Gluon; without it nothing here is used
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False

from ._jit import cdiv
from .ragged_gemm import GPU_CONFIG, _sm_count

BLOCK_M, BLOCK_K = GPU_CONFIG.block_m, 64
CONSUMER_WARPS = 4  # one warpgroup per consumer; two consumers take alternate tiles


if HAVE_GLUON:

    @gluon.jit
    def _loader(p, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr, EPI: gl.constexpr):
        """The load warp: for each of this program's tiles in turn, its K steps of A and B into the ring."""
        (a_desc, b_desc, a_bufs, b_bufs, c_smem, ready, empty, turn, tiles_ptr, num_n, K, N, B_ROWS, HALF, out_ptr,
         stride_om, aux_ptr, rw_ptr, order_ptr, dw_ptr, S) = p
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        total = gl.load(tiles_ptr) * num_n
        it = 0
        for t in range(gl.program_id(0), total, gl.num_programs(0)):
            m_tile = t // num_n
            n0 = (t % num_n) * BLOCK_N
            e = gl.load(tiles_ptr + 1 + 3 * m_tile)
            row0 = gl.load(tiles_ptr + 2 + 3 * m_tile)
            for k0 in range(0, K, BLOCK_K):
                s = it % STAGES
                # A stage starts free: waiting for the parity before the first completes at once.
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + BLOCK_N * BLOCK_K * 2)
                tma.async_copy_global_to_shared(a_desc, [row0, k0], ready.index(s), a_bufs.index(s))
                if EPI == 1:  # gate rows, then the up rows of the same columns, into the two halves
                    half_n: gl.constexpr = BLOCK_N // 2
                    tma.async_copy_global_to_shared(b_desc, [e * B_ROWS + n0 // 2, k0], ready.index(s),
                                                    b_bufs.index(s).slice(0, half_n))
                    tma.async_copy_global_to_shared(b_desc, [e * B_ROWS + HALF + n0 // 2, k0], ready.index(s),
                                                    b_bufs.index(s).slice(half_n, half_n))
                elif B_KMAJOR:
                    tma.async_copy_global_to_shared(b_desc, [e * B_ROWS + n0, k0], ready.index(s), b_bufs.index(s))
                else:
                    tma.async_copy_global_to_shared(b_desc, [e * B_ROWS + k0, n0], ready.index(s), b_bufs.index(s))
                it += 1

    @gluon.jit
    def _consume(p, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr, EPI: gl.constexpr,
                 c: gl.constexpr):
        """Consumer c (one warpgroup) computes every other tile of this program, c first.

        Its K loop runs while the other consumer writes its own tile (CUTLASS's ping-pong), so the
        epilogue's memory traffic overlaps the MMAs. Ring steps are numbered over all the program's
        tiles in order; each tile has the same number of K steps, so tile j's first step is j * n_k.
        EPI 1: out = h [S, 2N] (gate | up), aux = aw [S, N]. EPI 2: out = d_h [S, 2N], aux = the kept h.
        """
        (a_desc, b_desc, a_bufs, b_bufs, c_smem, ready, empty, turn, tiles_ptr, num_n, K, N, B_ROWS, HALF, out_ptr,
         stride_om, aux_ptr, rw_ptr, order_ptr, dw_ptr, S) = p
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        OUT_N: gl.constexpr = BLOCK_N // 2 if EPI == 1 else BLOCK_N  # output columns a tile
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
        total = gl.load(tiles_ptr) * num_n
        n_k = gl.cdiv(K, BLOCK_K)
        nprog = gl.num_programs(0)
        j = gl.program_id(0) * 0 + c  # this consumer's tiles: the program's j-th, j = c, c + 2, ...
        for t in range(gl.program_id(0) + c * nprog, total, 2 * nprog):
            m_tile = t // num_n
            n_tile = t % num_n
            row0 = gl.load(tiles_ptr + 2 + 3 * m_tile)
            row_end = gl.load(tiles_ptr + 3 + 3 * m_tile)
            acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
            # Wait until the other consumer has run the K loop of the tile before (its r-th for c = 1,
            # its (r-1)-th for c = 0, r = j // 2): the two K loops take turns, and a ring stage is
            # never waited on a whole lap early (mbarrier phases are told apart by parity only).
            mbarrier.wait(turn.index(1 - c), (j // 2 - 1 + c) & 1, pred=j > 0)
            it = j * n_k
            for kk in range(n_k):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                if B_KMAJOR:
                    acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
                else:
                    acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
                # This step's MMA in flight: the step before is done, its stage goes back.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=kk > 0)
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)  # the tile's last stage
            mbarrier.arrive(turn.index(c), count=1)  # the other consumer's K loop may start
            j += 2

            if EPI == 0:
                rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
                cols = n_tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
                mask = (rows < row_end)[:, None] & (cols < N)[None, :]
                gl.store(out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :],
                         acc.to(out_ptr.dtype.element_ty), mask=mask)
            elif EPI == 1:
                # columns 0..63 of the tile are gate, 64..127 the up of the same units: the split
                # keeps each value in its thread (a thread holds columns c and c + 64 alike)
                gate_r, up_r = acc.to(out_ptr.dtype.element_ty).reshape([BLOCK_M, 2, OUT_N]).permute((0, 2, 1)).split()
                half_l: gl.constexpr = gate_r.type.layout
                rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, half_l))
                cols = n_tile * OUT_N + gl.arange(0, OUT_N, layout=gl.SliceLayout(0, half_l))
                rmask = rows < row_end
                mask = rmask[:, None] & (cols < N)[None, :]
                r64 = rows.to(gl.int64)[:, None]
                gl.store(out_ptr + r64 * (2 * N) + cols[None, :], gate_r, mask=mask)
                gl.store(out_ptr + r64 * (2 * N) + N + cols[None, :], up_r, mask=mask)
                src = gl.load(order_ptr + rows, mask=rmask, other=0)
                w = gl.load(rw_ptr + src, mask=rmask, other=0.0).to(gl.float32)[:, None]
                gate = gate_r.to(gl.float32)
                up = up_r.to(gl.float32)
                # the SwiGLU pass's expression, operation for operation (same rounding)
                aw = w * (gate * (1 / (1 + gl.exp(-gate))) * up)
                gl.store(aux_ptr + r64 * N + cols[None, :], aw.to(aux_ptr.dtype.element_ty), mask=mask)
            else:
                # The dSwiGLU math needs g, gate, up and their products live at once: over the whole
                # accumulator that spills, and so does an unrolled loop over column chunks (the loads
                # of later chunks are hoisted). So g goes to shared memory as the unfused GEMM rounds it,
                # one [128, 32] slab per column chunk, and a rolled loop brings the slabs back in a
                # layout with 16-byte runs per thread, which also coalesces the h loads and d_h stores.
                gl.thread_barrier()  # every warp of this consumer is done with its last tile's slabs
                # columns a * 64 + b * 32 + i -> [row, i, b, a]; each split takes the last axis
                g4 = acc.to(out_ptr.dtype.element_ty).reshape([BLOCK_M, 2, 2, 32]).permute((0, 3, 2, 1))
                lo, hi = g4.split()
                g0, g1 = lo.split()
                g2, g3 = hi.split()
                c_smem.index(4 * c).store(g0)  # slabs 4c .. 4c + 3 are this consumer's
                c_smem.index(4 * c + 1).store(g1)
                c_smem.index(4 * c + 2).store(g2)
                c_smem.index(4 * c + 3).store(g3)
                gl.thread_barrier()
                chunk: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
                c_rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, chunk))
                c_rmask = c_rows < row_end
                src = gl.load(order_ptr + c_rows, mask=c_rmask, other=0)
                w = gl.load(rw_ptr + src, mask=c_rmask, other=0.0).to(gl.float32)[:, None]
                cr64 = c_rows.to(gl.int64)[:, None]
                part = gl.zeros((BLOCK_M, ), dtype=gl.float32, layout=gl.SliceLayout(1, chunk))
                for q in range(4):
                    c_cols = n_tile * OUT_N + q * 32 + gl.arange(0, 32, layout=gl.SliceLayout(0, chunk))
                    cmask = c_rmask[:, None] & (c_cols < N)[None, :]
                    g = c_smem.index(4 * c + q).load(chunk).to(gl.float32)
                    gate = gl.load(aux_ptr + cr64 * (2 * N) + c_cols[None, :], mask=cmask, other=0.0).to(gl.float32)
                    up = gl.load(aux_ptr + cr64 * (2 * N) + N + c_cols[None, :], mask=cmask, other=0.0).to(gl.float32)
                    sig = 1 / (1 + gl.exp(-gate))
                    act = gate * sig
                    a = act * up
                    d_a = w * g
                    gl.store(out_ptr + cr64 * (2 * N) + c_cols[None, :],
                             (d_a * up * sig * (1.0 + gate * (1.0 - sig))).to(out_ptr.dtype.element_ty), mask=cmask)
                    gl.store(out_ptr + cr64 * (2 * N) + N + c_cols[None, :], (d_a * act).to(out_ptr.dtype.element_ty),
                             mask=cmask)
                    part += gl.sum(g * a, axis=1)  # masked columns: gate = up = 0, so a = 0
                gl.store(dw_ptr + n_tile * S + src, part, mask=c_rmask)

    @gluon.jit
    def _consume_second(p, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr, EPI: gl.constexpr):
        _consume(p, BLOCK_N, STAGES, B_KMAJOR, EPI, 1)

    @gluon.jit
    def _ragged_kernel(a_desc, b_desc, tiles_ptr, num_n, K, N, B_ROWS, HALF,
                       out_ptr, stride_om, aux_ptr, rw_ptr, order_ptr, dw_ptr, S,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr, EPI: gl.constexpr):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        if EPI == 1:  # a stage holds the gate rows and the up rows of the same BLOCK_N // 2 columns
            b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N] + [b_desc.block_type.shape[1]],
                                               b_desc.layout)
        else:
            b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        if EPI == 2:  # each consumer's g, for the epilogue's column chunks
            gl.static_assert(BLOCK_N == 128, "the dSwiGLU epilogue splits the tile into four 32-column slabs")
            c_smem = gl.allocate_shared_memory(gl.bfloat16, [8, BLOCK_M, 32],
                                               gl.SwizzledSharedLayout(8, 1, 4, order=[1, 0]))
        else:
            c_smem = a_bufs  # unused
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        p = (a_desc, b_desc, a_bufs, b_bufs, c_smem, ready, empty, turn, tiles_ptr, num_n, K, N, B_ROWS, HALF, out_ptr,
             stride_om, aux_ptr, rw_ptr, order_ptr, dw_ptr, S)
        # 4 + 4 + 1 warps (the load warp rounds up to a warpgroup): 168 registers a thread fill the
        # register file; the load warp gives up all but 24, each consumer gets 240.
        gl.warp_specialize([
            (_consume, (p, BLOCK_N, STAGES, B_KMAJOR, EPI, 0)),
            (_consume_second, (p, BLOCK_N, STAGES, B_KMAJOR, EPI)),
            (_loader, (p, BLOCK_N, STAGES, B_KMAJOR, EPI)),
        ], [4, 1], [240, 24])


def _desc(t: torch.Tensor, block: list[int]):
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return TensorDescriptor.from_tensor(t, block, layout)


STAGES = {0: 5, 1: 5, 2: 4}  # 32 KB a stage; the dSwiGLU epilogue's slabs take 64 KB more


def _launch(a, b_desc, E, tiles, num_n, K, N, b_rows, half, out, aux, rw, order, dw, block_n, b_kmajor, epi):
    S = a.shape[0]
    a_desc = _desc(a, [BLOCK_M, BLOCK_K])
    grid = min(_sm_count(a.device), (S // BLOCK_M + E) * num_n)  # a bound on the tiles: the count is on the device
    dummy = out
    _ragged_kernel[(grid,)](
        a_desc, b_desc, tiles, num_n, K, N, b_rows, half, out, out.stride(0),
        dummy if aux is None else aux, dummy if rw is None else rw, tiles if order is None else order,
        dummy if dw is None else dw, S,
        block_n, STAGES[epi], b_kmajor, epi, num_warps=CONSUMER_WARPS, maxnreg=168,
    )


def suits(N: int, K: int) -> bool:
    """Whether the Gluon kernel beats ``ragged_gemm`` (Triton) on a row-ragged GEMM of B[e] [K, N].

    Measured on the H200 (bench/check_gluon_ragged_gpu.py; bench/KERNELS_NOTES.md): faster on the
    30B GEMMs with K of 1536-2048 (gate_up 1.346 vs 1.385 ms, dgrad 0.680 vs 0.728, dx 1.381 vs
    1.435 at T=16384), slower with K = 768 (down: 0.835 vs 0.796, the per-tile cost of 12 K steps),
    and much slower where one expert's weights exceed ~8 MB (235B gate_up 7.23 vs 5.36 ms): its
    128 x 128 tiles keep twice as many experts' weight tiles in flight as Triton's 128 x 256.
    """
    return HAVE_GLUON and K > 1024 and N * K * 2 <= 8 << 20


# (EPI, b_kmajor, BLOCK_N) of every launch above: plain with either weight layout, and the two fused ones
LAUNCHES = ((0, True, 128), (0, False, 128), (1, True, 128), (2, False, 128))


def compile_sm90(epi: int, b_kmajor: bool, block_n: int):
    """Compile one launch's kernel for sm90 without a GPU (triton.compile): its ``asm["ptx"]`` and
    ``metadata.shared`` show what the H200 would run. The CPU-side check of this module (no interpreter
    runs Gluon)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    a_desc = _desc(torch.empty(256, 128, dtype=torch.bfloat16), [BLOCK_M, BLOCK_K])
    b_block = [block_n // 2 if epi == 1 else block_n, BLOCK_K] if b_kmajor else [BLOCK_K, block_n]
    b_desc = _desc(torch.empty(1024, 512, dtype=torch.bfloat16), b_block)
    sig = {"a_desc": mangle_type(a_desc), "b_desc": mangle_type(b_desc), "tiles_ptr": "*i32", "num_n": "i32",
           "K": "i32", "N": "i32", "B_ROWS": "i32", "HALF": "i32", "out_ptr": "*bf16", "stride_om": "i32",
           "aux_ptr": "*bf16", "rw_ptr": "*bf16", "order_ptr": "*i32", "dw_ptr": "*fp32", "S": "i32"}
    consts = dict(BLOCK_N=block_n, STAGES=STAGES[epi], B_KMAJOR=b_kmajor, EPI=epi)
    sig.update({name: "constexpr" for name in consts})
    return triton.compile(GluonASTSource(_ragged_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": CONSUMER_WARPS, "maxnreg": 168})


def _check(a, name):
    if not (HAVE_GLUON and a.is_cuda and a.dtype == torch.bfloat16 and a.is_contiguous()):
        raise ValueError(f"gluon_ragged.{name}: needs Gluon and contiguous bf16 CUDA operands")


def ragged_gemm(a, b, tiles, *, b_kmajor: bool) -> torch.Tensor:
    """``ragged_gemm.ragged_gemm``'s product on the H200: out [R, N] = a[p] @ B[e] per tile of ``tiles``."""
    _check(a, "ragged_gemm")
    E = b.shape[0]
    N, K = (b.shape[1], b.shape[2]) if b_kmajor else (b.shape[2], b.shape[1])
    block_n = 128
    out = torch.empty(a.shape[0], N, dtype=a.dtype, device=a.device)
    if b_kmajor:
        b_desc, b_rows = _desc(b.view(E * N, K), [block_n, BLOCK_K]), N
    else:
        b_desc, b_rows = _desc(b.view(E * K, N), [BLOCK_K, block_n]), K
    _launch(a, b_desc, E, tiles, cdiv(N, block_n), K, N, b_rows, 0, out, None, None, None, None, block_n, b_kmajor, 0)
    return out


def gate_up_swiglu(xs, w_gate_up, tiles, rw, order):
    """(h [S, 2I], aw [S, I]): h = xs @ W_gate_up[e]^T and aw = w * silu(gate) * up, one kernel.

    w_gate_up [E, 2I, H] (gate rows, then up rows); rw [T * k] routing weights by row; order the
    routing's sorted position -> row.
    """
    _check(xs, "gate_up_swiglu")
    E, two_i, H = w_gate_up.shape
    I = two_i // 2
    block_n = 128  # a tile: 64 gate and the 64 up columns of the same units
    S = xs.shape[0]
    h = torch.empty(S, two_i, dtype=xs.dtype, device=xs.device)
    aw = torch.empty(S, I, dtype=xs.dtype, device=xs.device)
    b_desc = _desc(w_gate_up.view(E * two_i, H), [block_n // 2, BLOCK_K])
    _launch(xs, b_desc, E, tiles, cdiv(I, block_n // 2), H, I, two_i, I, h, aw, rw, order, None, block_n, True, 1)
    return h, aw


def dgrad_dswiglu(dys, w_down, h, tiles, rw, order, weights_dtype):
    """(d_h [S, 2I], d_weights [S] by row): g = dys @ W_down[e] and the dSwiGLU pass, one kernel.

    w_down [E, H, I]; h the forward's [S, 2I]. Rows in no tile get d_weights 0.
    """
    _check(dys, "dgrad_dswiglu")
    E, H, I = w_down.shape
    S = dys.shape[0]
    block_n = 128
    num_n = cdiv(I, block_n)
    dh = torch.empty(S, 2 * I, dtype=dys.dtype, device=dys.device)
    parts = torch.zeros(num_n, S, dtype=torch.float32, device=dys.device)
    b_desc = _desc(w_down.view(E * H, I), [BLOCK_K, block_n])
    _launch(dys, b_desc, E, tiles, num_n, H, I, H, 0, dh, h, rw, order, parts, block_n, False, 2)
    return dh, parts.sum(0).to(weights_dtype)


__all__ = ["HAVE_GLUON", "LAUNCHES", "compile_sm90", "dgrad_dswiglu", "gate_up_swiglu", "ragged_gemm", "suits"]
