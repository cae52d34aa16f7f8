"""The experts block as GEMMs on expert-sorted operands, with Triton kernels around them.

Where it applies (``dispatch.grouped_mm_applies``: CUDA sm90+, everything bf16, 16-byte rows), grouped GEMMs
on contiguous, expert-sorted operands run faster than the fused Triton GEMMs that gather their rows inside the
A-load (docs/kernels.md). The weight gradients go through ``torch._grouped_mm`` (CUTLASS); the four row-ragged
GEMMs through ``ragged_gemm`` when the caller says ``ragged`` (``dispatch.ragged``: from
``config.ragged_min_rows`` routed rows up; same results bit for bit, less of each expert's tail computed), else
through ``torch._grouped_mm`` too. The price is the expert-sorted copies
of x (kept from the forward for the backward, with h [S, 2I] and the routing) and of dy, [S, H]
each, in memory. The Triton kernels keep what a GEMM library does not do: the routing, the sorted
copies (``permute.expand_rows``), SwiGLU, the dSwiGLU pass with the routing-weight gradient, and
fixed-order combines. ``dispatch.plan`` picks this path when h is kept for the backward anyway (``save_h``);
without, the fused Triton forward never writes h and is faster on the 30B layer.

    forward   xs = x[tok]                          [S, H]  (tok = routing.token: rows sorted by expert)
              h  = xs @ W_gate_up[e]^T             [S, 2I] (gate | up)
              aw = w * silu(gate) * up             [S, I]  (w: the row's routing weight; gate_up bias added first)
              o  = aw @ W_down[e]^T                [S, H]
              y[t] = sum_j o[pos[t, j]]            (fp32, j in order; sentinel slots skipped)
              h, xs, aw and the routing are kept for the backward
    backward  dys = dy[tok];  g = dys @ W_down[e]  [S, I]
              d_h, d_weights = the dSwiGLU pass of backward.py (d_weights = sum_i g * a)
              dW_gate_up[e] = d_h[e]^T xs[e];  dW_down[e] = dys[e]^T aw[e];  d_bias[e] = sum of d_h[e]
              o' = d_h @ W_gate_up[e]              [S, H];  dx[t] = sum_j o'[pos[t, j]]

Experts without a gate (``reference.UNGATED``: Nemotron-H) take the same steps with W_up [E, I, H] in place of
W_gate_up, h [S, I], and the passes of ``ungated.py`` in place of SwiGLU and dSwiGLU.

Groups are ``offsets[1:]``: rows past offsets[E] (expert-parallel sentinels) are in no group, so
``_grouped_mm`` leaves them unwritten and no later step reads them. An expert without rows gets
zero weight gradients. Every step is deterministic (no atomics, no split-K).
"""

from __future__ import annotations

import torch
import triton.language as tl

from ..reference import gated, limit_in, softcaps
from ._jit import cdiv, interpreting, lazy_jit
from . import transposed
from . import ungated
from .backward import bias_operands, check_saved_h, dswiglu, expert_sums
from .jit_math import glu, load_gate_up
from .permute import combine_sorted, expand_rows
from .ragged_gemm import ragged_gemm, tile_map
from .routing import Routing, route

@lazy_jit
def _swiglu_kernel(
    h_ptr,  # [S, 2I] sorted order: gate | up
    rw_ptr,  # [T * k] routing weights, by row (slot)
    order_ptr,  # [S] int32: sorted position -> row
    a_ptr,  # [S, I] out
    offsets_ptr,  # [E + 1] int32; offsets[E] = routed rows
    bias_ptr,  # [E, 2I] gate_up bias, h's column order (HAS_BIAS)
    ids_ptr,  # [T * k] expert of each row (HAS_BIAS)
    S,
    I,
    E,
    limit,  # swiglu_limit in h's dtype (LIMITED)
    alpha,  # glu_alpha (ALPHA_GATE)
    gate_cap,  # softcap of the gate's linear factor (SOFTCAP)
    up_cap,  # softcap of up (SOFTCAP)
    LIMITED: tl.constexpr,  # gate.clamp(max=limit), up.clamp(-limit, limit) first
    ALPHA_GATE: tl.constexpr,  # gate * sigmoid(alpha * gate) * (up + 1) instead of silu(gate) * up
    GELU_TANH: tl.constexpr,  # gelu(gate, approximate="tanh") * up (GeGLU) instead of silu(gate) * up
    SOFTCAP: tl.constexpr,  # softcap(gate) * sigmoid(gate) * softcap(up), softcap(v) = cap * tanh(v / cap)
    HAS_BIAS: tl.constexpr,  # h + bias[e] first (in fp32)
    INTERLEAVED: tl.constexpr,  # gate, up = h's even, odd columns (GPT-OSS) instead of its two halves
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """aw = silu(gate) * up * w in fp32, rounded once; rows past offsets[E] are not written.

    a = jit_math.glu, the products of the dSwiGLU pass's a (backward.py), so the two round to the same aw.
    """
    p = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    routed = (p < S) & (p < tl.load(offsets_ptr + E))
    src = tl.load(order_ptr + p, mask=routed, other=0)
    w = tl.load(rw_ptr + src, mask=routed, other=0.0).to(tl.float32)[:, None]
    p64 = p.to(tl.int64)[:, None]
    e64 = p64  # each row's expert with HAS_BIAS; not read without
    if HAS_BIAS:
        e64 = tl.load(ids_ptr + src, mask=routed, other=0).to(tl.int64)[:, None]
    for i0 in range(0, I, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        mask = routed[:, None] & (i < I)[None, :]
        gate, up = load_gate_up(h_ptr, bias_ptr, p64, e64, i0, i, I, routed, mask, HAS_BIAS, INTERLEAVED, BLOCK_R,
                                BLOCK_I)
        aw = w * glu(gate, up, limit, alpha, gate_cap, up_cap, LIMITED, ALPHA_GATE, GELU_TANH, SOFTCAP)
        tl.store(a_ptr + p64 * I + i[None, :], aw.to(a_ptr.dtype.element_ty), mask=mask)


def swiglu(h: torch.Tensor, routing: Routing, rw: torch.Tensor, swiglu_limit: float | None = None,
           glu_alpha: float | None = None, activation: str = "silu", gate_up_bias: torch.Tensor | None = None,
           ids: torch.Tensor | None = None, interleaved: bool = False) -> torch.Tensor:
    """aw [S, I] = w * silu(gate) * up in h's dtype, sorted order; rw [T * k] the routing weights by row.

    swiglu_limit: gate and up clamped first (``reference.clamp_gate_up``); glu_alpha, activation: ``reference.glu``'s
    gate. gate_up_bias [E, 2I] (with ids [T, k], the experts of the rows): added to h first. interleaved: gate and
    up are h's even and odd columns (``reference.split_gate_up``)."""
    S, two_i = h.shape
    I = two_i // 2
    E = routing.counts.numel()
    a = torch.empty(S, I, dtype=h.dtype, device=h.device)
    # 4 x 256: 150 us against 161 at 16 x 128 (30B, T=16384, H200; the pass-config probe at da3be06).
    block_r, block_i = (4, 32) if interpreting() else (4, 256)
    limit = limit_in(h.dtype, swiglu_limit)
    caps = softcaps(activation)
    bias, row_experts = bias_operands(gate_up_bias, ids, E, two_i, routing.order)
    _swiglu_kernel[(cdiv(S, block_r),)](
        h, rw, routing.order, a, routing.offsets, bias, row_experts, S, I, E, 0.0 if limit is None else limit,
        1.0 if glu_alpha is None else float(glu_alpha), *(caps or (1.0, 1.0)), LIMITED=limit is not None,
        ALPHA_GATE=glu_alpha is not None, GELU_TANH=activation == "gelu_tanh", SOFTCAP=caps is not None,
        HAS_BIAS=gate_up_bias is not None, INTERLEAVED=interleaved,
        BLOCK_R=block_r, BLOCK_I=block_i, num_warps=4,
    )
    return a


def _row_gemm(a, w, tiles, ends, *, w_kmajor):
    """a[p] @ W[e] for each expert's rows: W[e] = w[e]^T with ``w_kmajor`` (nn.Linear weights), else w[e].

    tiles: ``tile_map(routing.offsets, S)``, or None for ``torch._grouped_mm`` (``_tiles``). A ``transposed`` w
    goes to the Triton GEMM as the contiguous tensor it is a view of, in the other operand layout."""
    if tiles is not None and transposed(w):
        return ragged_gemm(a, w.transpose(1, 2), tiles, b_kmajor=not w_kmajor)
    if tiles is not None:
        return ragged_gemm(a, w, tiles, b_kmajor=w_kmajor)
    return torch._grouped_mm(a, w.transpose(1, 2) if w_kmajor else w, offs=ends)


BUILD = object()  # the default of a ``tiles`` argument: build the tile map (None is a value: torch's GEMMs)


def _tiles(routing: Routing, rows: int, ragged: bool):
    """The tile map of the Triton ragged GEMM (``ragged``: ``dispatch.ragged``), else None: torch._grouped_mm."""
    return tile_map(routing.offsets, rows) if ragged else None


def experts_forward(x, ids, weights, w_gate_up, w_down, *, save_h: bool = False, keep_rows: bool = False,
                    swiglu_limit: float | None = None, glu_alpha: float | None = None, activation: str = "silu",
                    gate_up_bias=None, interleaved: bool = False, ragged: bool = False):
    """Same contract as ``forward.experts_forward`` (y, or (y, h, routing) with ``save_h``); needs S > 0.
    gate_up_bias, interleaved: as ``reference.experts_forward``'s (h is kept without the bias).

    keep_rows (with save_h): (y, h, routing, xs, aw), the two GEMM operands the backward's weight
    gradients read: xs [S, H] the expert-sorted rows of x (dW_gate_up; else one more gather, ~0.16 ms
    on a 30B layer at T=16384) and aw [S, I] = w * SwiGLU(h) (dW_down; else the dSwiGLU pass writes
    it again). Together +S*(H+I)*2 bytes kept per layer.
    """
    T, k = ids.shape
    E = w_gate_up.shape[0]
    routing = route(ids, E)
    ends = routing.offsets[1:]
    tiles = _tiles(routing, T * k, ragged)
    xs = expand_rows(x, routing.pos.view(T, k))  # = x[routing.token], reading x once
    rw = weights.reshape(-1).contiguous()
    # The routing weight scales the down GEMM's input rows, not its output: the combine then only
    # sums, and the scaled rows are dW_down's operand too.
    # What is not returned is dropped once read (xs after the gate_up GEMM, h without save_h after the
    # activation): the forward without h then never holds xs, h and aw at once.
    kept_xs = xs if save_h and keep_rows else None
    h = _row_gemm(xs, w_gate_up, tiles, ends, w_kmajor=True)
    del xs
    if gated(activation):
        aw = swiglu(h, routing, rw, swiglu_limit, glu_alpha, activation, gate_up_bias, ids, interleaved)
    else:  # up projection only: h [S, I]
        aw = ungated.act(h, routing, rw, activation)
    if not save_h:
        del h
    o = _row_gemm(aw, w_down, tiles, ends, w_kmajor=True)
    y = combine_sorted(o, routing.pos.view(T, k), None, x.dtype, ids=ids, num_experts=E)
    if not save_h:
        return y
    return (y, h, routing, kept_xs, aw) if keep_rows else (y, h, routing)


def experts_backward(dy, x, ids, weights, w_gate_up, w_down, h=None, *, routing=None, xs=None, aw=None,
                     swiglu_limit: float | None = None, glu_alpha: float | None = None, activation: str = "silu",
                     gate_up_bias=None, interleaved: bool = False, ragged: bool = False):
    """Same contract as ``backward.experts_backward``; needs S > 0. With gate_up_bias (``reference.experts_backward``'s,
    as interleaved): (..., d_gate_up_bias), each expert's rows of d_h summed.

    h, routing, xs, aw: what the forward kept (``experts_forward(save_h=True, keep_rows=True)``), each
    None to recompute it (h: one more GEMM; routing: three small launches; xs: a gather; aw: written by
    the dSwiGLU pass, from h). ``backward_down``, ``backward_gate_up`` and ``backward_weight_gate_up``: the op
    calls them as three ops where the forward kept h, so that the compiled backward frees h and aw after the
    first and can run dW_gate_up when it pays.
    """
    T, k = ids.shape
    E = w_gate_up.shape[0]
    S, H = T * k, x.shape[1]
    check_saved_h(h, S, w_gate_up)
    check_kept(xs, S, H, x.dtype, "rows", "H")
    ids = ids.contiguous()
    if routing is None:
        routing = route(ids, E)
    tiles = _tiles(routing, S, ragged)  # one tile map for the four row-ragged GEMMs
    if h is None:
        if xs is None:
            xs = expand_rows(x, routing.pos.view(T, k))
        h = _row_gemm(xs, w_gate_up, tiles, routing.offsets[1:], w_kmajor=True)
    dh, d_weights, d_wd = backward_down(dy, ids, weights, w_down, h, routing, aw, swiglu_limit=swiglu_limit,
                                        glu_alpha=glu_alpha, activation=activation, gate_up_bias=gate_up_bias,
                                        interleaved=interleaved, tiles=tiles)
    del h  # frees it where recomputed here
    dx, d_bias = backward_gate_up(dh, x, ids, w_gate_up, routing, tiles=tiles,
                                  bias_dtype=None if gate_up_bias is None else gate_up_bias.dtype)
    d_wgu = backward_weight_gate_up(dh, x, ids, w_gate_up, routing, xs)
    grads = dx, d_weights, d_wgu, d_wd
    return grads if d_bias is None else (*grads, d_bias)


def check_kept(t, S: int, cols: int, dtype, name: str, dim: str):
    """A kept operand (xs, aw) must be what the forward wrote: a contiguous [S, cols] tensor of dtype, or None."""
    if t is not None and (tuple(t.shape) != (S, cols) or t.dtype != dtype or not t.is_contiguous()):
        raise ValueError(
            f"experts_backward: saved {name} must be a contiguous [S={S}, {dim}={cols}] {dtype} tensor, "
            f"got {tuple(t.shape)} {t.dtype}"
        )


def backward_down(dy, ids, weights, w_down, h, routing: Routing, aw=None, *, swiglu_limit: float | None = None,
                  glu_alpha: float | None = None, activation: str = "silu", gate_up_bias=None,
                  interleaved: bool = False, ragged: bool = False, tiles=BUILD):
    """The backward's first half, from dy to d_h: (d_h [S, 2I] (experts without a gate: [S, I]), d_weights [T, k],
    dW_down). Reads h and aw (None: the dSwiGLU pass writes it), which nothing after it reads. tiles: the caller's
    ``_tiles(routing, S)``, else built here.

    Memory order: with aw kept, dW_down runs right after the dgrad GEMM, so the sorted copy of dy is freed before
    the dSwiGLU pass allocates d_h (the layer's backward then never holds dys and d_h at once).
    """
    T, k = ids.shape
    S, I = T * k, w_down.shape[2]
    if h is None:
        raise ValueError("backward_down: needs the forward's h")
    check_kept(h, S, 2 * I if gated(activation) else I, w_down.dtype, "h", "2I" if gated(activation) else "I")
    check_kept(aw, S, I, w_down.dtype, "aw", "I")
    dy = dy.contiguous()  # the gradient of a sum arrives with stride 0
    ends = routing.offsets[1:]
    tiles = _tiles(routing, S, ragged) if tiles is BUILD else tiles
    dys = expand_rows(dy, routing.pos.view(T, k))
    rw = weights.reshape(-1).contiguous()
    g = _row_gemm(dys, w_down, tiles, ends, w_kmajor=False)  # [S, I]
    d_wd = None
    if aw is not None:
        d_wd = _wgrad(dys, aw, routing.offsets, transposed(w_down))
        del dys
    if gated(activation):
        dh, aw_now, d_weights = dswiglu(
            g, h, rw, routing, weights.dtype, write_aw=aw is None, swiglu_limit=swiglu_limit, glu_alpha=glu_alpha,
            activation=activation, gate_up_bias=gate_up_bias, ids=ids, interleaved=interleaved,
        )
    else:  # d_h [S, I]
        dh, aw_now, d_weights = ungated.dact(g, h, rw, routing, weights.dtype, write_aw=aw is None,
                                             activation=activation)
    del g
    if d_wd is None:
        d_wd = _wgrad(dys, aw_now, routing.offsets, transposed(w_down))
    return dh, d_weights.view(T, k), d_wd


def backward_gate_up(dh, x, ids, w_gate_up, routing: Routing, *, bias_dtype=None, ragged: bool = False, tiles=BUILD):
    """The backward's second half, from d_h: (dx, d_gate_up_bias in bias_dtype or None). tiles: as
    ``backward_down``'s. dW_gate_up is ``backward_weight_gate_up``'s: apart, so that a compiled backward can run it
    later (it reads d_h and xs, and nothing after it in the layer's backward reads its [E, 2I, H] result)."""
    T, k = ids.shape
    S, E = T * k, w_gate_up.shape[0]
    ends = routing.offsets[1:]
    tiles = _tiles(routing, S, ragged) if tiles is BUILD else tiles
    # One stream: each CUTLASS GEMM fills every SM, so a weight-gradient GEMM on a second stream only
    # starts when the one before it ends (a paced layer trace on an H200, da3be06's bench/trace_layer_gpu.py); layer steps
    # measured the same with and without (docs/performance.md).
    o = _row_gemm(dh, w_gate_up, tiles, ends, w_kmajor=False)  # [S, H]
    dx = combine_sorted(o, routing.pos.view(T, k), None, x.dtype, ids=ids, num_experts=E)
    del o
    d_bias = None if bias_dtype is None else expert_sums(dh, routing, bias_dtype)
    return dx, d_bias


def backward_weight_gate_up(dh, x, ids, w_gate_up, routing: Routing, xs=None):
    """dW_gate_up from d_h and the expert-sorted rows of x the forward kept (xs), or gathered again (None)."""
    T, k = ids.shape
    if xs is None:
        xs = expand_rows(x, routing.pos.view(T, k))
    return _wgrad(dh, xs, routing.offsets, transposed(w_gate_up))


def _wgrad(p, q, offsets, in_transposed: bool):
    """[E, M, N] with [e] = p[rows of e]^T q[rows of e] (p [S, M], q [S, N]); with ``in_transposed`` computed as
    the contiguous [E, N, M] of q^T p and returned as its transpose: the layout of weights stored transposed."""
    if in_transposed:
        p, q = q, p
    out = torch._grouped_mm(p.t(), q, offs=offsets[1:])
    return out.transpose(1, 2) if in_transposed else out


__all__ = ["backward_down", "backward_gate_up", "backward_weight_gate_up", "experts_backward", "experts_forward",
           "swiglu"]
