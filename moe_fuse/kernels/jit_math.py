"""The kernels' shared elementwise math, as ``jit_helper``s (device functions jitted with their caller: _jit.py).

    clamp_gate_up(gate, up, limit)      gate.clamp(max=limit), up.clamp(-limit, limit)   (reference.clamp_gate_up)
    gate_up_in_limit(gate, up, limit)   where that clamp passes the gradient
    softcap_tanh(v)                     tanh(v) for the softcapped SwiGLU, cap * tanh(v / cap)
    glu_terms(gate, up, ...)            the factors of reference.glu's gated activation: a = act * up_term
    glu(gate, up, ...)                  a = act * up_term, gate and up clamped first if LIMITED  (SwiGLU, GeGLU, ...)
    dglu(d_a, gate, up, <glu_terms>)    the gradients of gate and up given d_a = da               (dSwiGLU, ...)
    load_gate_up(h_ptr, ...)            a chunk of gate and up from h [S, 2I] (halves or interleaved), plus bias
    relu(x)                             max(x, 0) with NaN kept (the ungated experts' squared ReLU)
    masked_softmax(logits, valid)       fp32 softmax along rows, zero outside ``valid`` (the router)

All fp32. Each is the expression its callers had inline, operation for operation: Triton inlines device functions,
so a call compiles to what the pasted body did, and the order of the products (which decides the rounding) is the
helper's. The forward SwiGLU (``glu``) and the backward passes form a from ``glu_terms`` with the same products, so
the forward's aw and the dSwiGLU pass's round the same.

The backward passes (backward.py: ``_dgrad_kernel``'s epilogue, ``_dswiglu_kernel``) compute in this order, the
order their inline code had (ptxas schedules from the instruction order, so another order compiles to other
machine code):

    if LIMITED:
        g_in, u_in = gate_up_in_limit(gate, up, limit)
        gate, up = clamp_gate_up(gate, up, limit)
    sig, act, up_term, tg, tu = glu_terms(gate, up, ...)
    a = act * up_term
    (its row sums of g * a)
    d_gate, d_up = dglu(w * g, gate, up, sig, act, up_term, tg, tu, ...)
    if LIMITED: d_gate, d_up zeroed where not g_in, u_in
"""

from __future__ import annotations

import triton.language as tl

from ._jit import jit_helper


@jit_helper
def clamp_gate_up(gate, up, limit):
    """(gate.clamp(max=limit), up.clamp(-limit, limit)), NaN propagated as eager's clamp does."""
    gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
    up = tl.minimum(tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL), limit, propagate_nan=tl.PropagateNan.ALL)
    return gate, up


@jit_helper
def gate_up_in_limit(gate, up, limit):
    """(g_in, u_in): where ``clamp_gate_up`` passes the gradient of gate and up (eager's clamp backward: the bound
    itself passes)."""
    g_in = gate <= limit
    u_in = (up >= -limit) & (up <= limit)
    return g_in, u_in


@jit_helper
def softcap_tanh(v):
    """tanh(v): (1 - e) / (1 + e), e = exp(-2|v|), with v's sign; below |v| = 1/4, where 1 - e cancels, its series
    to v^9 (error < 1e-8 relative)."""
    e = tl.exp(-2.0 * tl.abs(v))
    v2 = v * v
    series = v * (1.0 + v2 * (-1.0 / 3 + v2 * (2.0 / 15 + v2 * (-17.0 / 315 + v2 * (62.0 / 2835)))))
    return tl.where(tl.abs(v) < 0.25, series, tl.where(v < 0, -1.0, 1.0) * ((1.0 - e) / (1.0 + e)))


@jit_helper
def glu_terms(gate, up, alpha, gate_cap, up_cap, ALPHA_GATE: tl.constexpr, GELU_TANH: tl.constexpr,
              SOFTCAP: tl.constexpr):
    """(sig, act, up_term, tg, tu): the gated activation is a = act * up_term, act = gate's factor, sig the sigmoid
    in it; tg, tu the tanh of the softcaps (SOFTCAP; otherwise gate and up, unread).

        default      act = gate * sigmoid(gate)                        up_term = up      (silu)
        ALPHA_GATE   act = gate * sigmoid(alpha * gate)                up_term = up + 1  (GPT-OSS)
        GELU_TANH    act = gate * sigmoid(u), u = 2 sqrt(2 / pi) (gate + 0.044715 gate^3): gelu's tanh form
        SOFTCAP      act = tanh(gate / gate_cap) * gate_cap * sigmoid(gate)    up_term = tanh(up / up_cap) * up_cap
    """
    tg = gate
    tu = up
    if ALPHA_GATE:
        sig = tl.sigmoid(alpha * gate)
        act = gate * sig
        up_term = up + 1.0
    elif GELU_TANH:
        sig = tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
        act = gate * sig
        up_term = up
    elif SOFTCAP:
        tg = softcap_tanh(gate / gate_cap)
        tu = softcap_tanh(up / up_cap)
        sig = tl.sigmoid(gate)
        act = tg * gate_cap * sig
        up_term = tu * up_cap
    else:
        sig = tl.sigmoid(gate)
        act = gate * sig  # silu(gate)
        up_term = up
    return sig, act, up_term, tg, tu


@jit_helper
def glu(gate, up, limit, alpha, gate_cap, up_cap, LIMITED: tl.constexpr, ALPHA_GATE: tl.constexpr,
        GELU_TANH: tl.constexpr, SOFTCAP: tl.constexpr):
    """The gated activation a = act * up_term (``glu_terms``) of gate and up (clamped first when LIMITED), as ``dglu``
    forms it."""
    if LIMITED:
        gate, up = clamp_gate_up(gate, up, limit)
    sig, act, up_term, tg, tu = glu_terms(gate, up, alpha, gate_cap, up_cap, ALPHA_GATE, GELU_TANH, SOFTCAP)
    return act * up_term


@jit_helper
def dglu(d_a, gate, up, sig, act, up_term, tg, tu, alpha, ALPHA_GATE: tl.constexpr, GELU_TANH: tl.constexpr,
         SOFTCAP: tl.constexpr):
    """(d_gate, d_up): the gradients of gate and up (after any clamp) given d_a, the gradient of the activation
    a = act * up_term; sig, act, up_term, tg, tu: ``glu_terms`` of gate and up."""
    if ALPHA_GATE:
        d_gate = d_a * up_term * sig * (1.0 + alpha * gate * (1.0 - sig))
    elif GELU_TANH:  # d(gate * sigmoid(u)) = sig * (1 + gate * (1 - sig) * du), du = C * (1 + 3 * 0.044715 * gate^2)
        d_gate = d_a * up * sig * (1.0 + 1.5957691216057308 * (1.0 + 0.134145 * gate * gate) * gate * (1.0 - sig))
    elif SOFTCAP:  # d act = sig (1 - tg^2) + act (1 - sig); d up_term = 1 - tu^2
        d_gate = d_a * up_term * (sig * (1.0 - tg * tg) + act * (1.0 - sig))
    else:
        d_gate = d_a * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = d_a * act
    if SOFTCAP:
        d_up = d_up * (1.0 - tu * tu)
    return d_gate, d_up


@jit_helper
def load_gate_up(h_ptr, bias_ptr, p64, e64, i0, i, I, routed, mask, HAS_BIAS: tl.constexpr,
                 INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    """(gate, up) [BLOCK_R, BLOCK_I] fp32: columns i = i0 + arange(BLOCK_I) of gate and up of the rows p64 [BLOCK_R, 1]
    of h [S, 2I], masked by ``mask``; HAS_BIAS: plus the rows e64 [BLOCK_R, 1] of bias [E, 2I] (h's column order).
    h holds gate | up, or with INTERLEAVED gate and up in its even and odd columns (GPT-OSS), read as one
    [BLOCK_R, 2 * BLOCK_I] load split in two."""
    if INTERLEAVED:
        c = 2 * i0 + tl.arange(0, 2 * BLOCK_I)
        pmask = routed[:, None] & (c < 2 * I)[None, :]
        pair = tl.load(h_ptr + p64 * (2 * I) + c[None, :], mask=pmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            pair += tl.load(bias_ptr + e64 * (2 * I) + c[None, :], mask=pmask, other=0.0).to(tl.float32)
        gate, up = tl.split(tl.reshape(pair, (BLOCK_R, BLOCK_I, 2)))
    else:
        gate = tl.load(h_ptr + p64 * (2 * I) + i[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + p64 * (2 * I) + I + i[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            gate += tl.load(bias_ptr + e64 * (2 * I) + i[None, :], mask=mask, other=0.0).to(tl.float32)
            up += tl.load(bias_ptr + e64 * (2 * I) + I + i[None, :], mask=mask, other=0.0).to(tl.float32)
    return gate, up


@jit_helper
def relu(x):
    """max(x, 0), NaN propagated (torch's relu)."""
    return tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)


@jit_helper
def masked_softmax(logits, valid):
    """Softmax along rows of fp32 logits [R, C] (-inf where not ``valid``), 0 where not ``valid``."""
    peak = tl.max(logits, axis=1)
    p = tl.where(valid, tl.exp(logits - peak[:, None]), 0.0)
    return p / tl.sum(p, axis=1)[:, None]
