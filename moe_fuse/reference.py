"""Plain-PyTorch math of the fused MoE ops: forward and an explicit backward.

This is the CPU implementation of ``torch.ops.moe_fuse.*`` (and the CUDA one
where no Triton kernel applies), and the reference every kernel is tested
against. The backward is written out by hand, not taken from autograd, because
it is the contract the fused backward kernels implement.

Notation: T tokens, k experts per token, S = T*k routed rows, E experts,
H hidden, I intermediate. ``w_gate_up`` is [E, 2I, H] with the gate rows first,
``w_down`` is [E, H, I] (transformers 5.x layout). Experts without a gate (``UNGATED``
activations: Nemotron-H's squared ReLU) have an up projection only: ``w_gate_up`` is then
[E, I, H] and h [S, I].
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F


# --------------------------------------------------------------------------- router


def router_forward(x, weight, top_k: int, renorm: bool, weights_dtype: torch.dtype):
    """linear -> softmax(fp32) -> top-k -> optional renorm -> cast. Returns (logits, weights, ids)."""
    logits = F.linear(x, weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    values, ids = torch.topk(probs, top_k, dim=-1)
    if renorm:
        values = values / values.sum(dim=-1, keepdim=True)
    return logits, values.to(weights_dtype), ids


def router_backward(d_logits, d_weights, x, weight, logits, ids, renorm: bool):
    """Gradients of router_forward w.r.t. x and weight, given the gradients of its two float outputs."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    values = probs.gather(-1, ids)
    d_values = d_weights.float()
    if renorm:
        total = values.sum(dim=-1, keepdim=True)
        w = values / total
        d_values = (d_values - (d_values * w).sum(dim=-1, keepdim=True)) / total
    d_probs = torch.zeros_like(probs).scatter_(-1, ids, d_values)
    d_scores = probs * (d_probs - (d_probs * probs).sum(dim=-1, keepdim=True))
    d_logits = (d_scores + d_logits.float()).to(logits.dtype)
    return d_logits @ weight, d_logits.t() @ x


# --------------------------------------------------------------------------- experts


def expert_order(ids: torch.Tensor, num_experts: int):
    """Rows (token*k + slot) sorted by expert, stable, and the row count of each expert.

    Ids >= num_experts are expert-parallel sentinels (experts of another rank):
    they sort to the tail, are counted nowhere and contribute zero, as in transformers
    (``experts_forward`` says what that means for their routing weights).
    """
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat.clamp(max=num_experts), minlength=num_experts + 1)[:num_experts]
    return order, counts


def _expert_slices(counts: torch.Tensor):
    # One host sync for the whole layer; the Triton path has none.
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            yield e, slice(start, start + n)
        start += n


def limit_in(dtype: torch.dtype, swiglu_limit: float | None) -> float | None:
    """The clamp bound as the gate_up output's dtype holds it: eager clamps h in that dtype, so clamped
    values are L rounded to it, and its backward compares h with that same rounded L."""
    if swiglu_limit is None:
        return None
    return torch.tensor(swiglu_limit, dtype=dtype).item()


def clamp_gate_up(gate, up, limit: float | None):
    """transformers' ``swiglu_limit``: gate.clamp(max=L), up.clamp(-L, L) (no-op for None)."""
    if limit is None:
        return gate, up
    return gate.clamp(max=limit), up.clamp(min=-limit, max=limit)


ACTIVATIONS = ("silu", "gelu_tanh", "relu2")  # and ``softcapped(Cg, Cu)``, an activation with constants
# "softcapped_silu" carries its two constants in its name, ``softcapped(gate_cap, up_cap)``: Inkling 2's
# SwiGLU, softcap(gate, Cg) * sigmoid(gate) * softcap(up, Cu) in fp32 with softcap(v, C) = C * tanh(v / C).
# That is the spelling of this module's and the kernels' ``activation`` argument; the op takes the caps as fields
# of its epilogue (``spec.Epilogue``, whose ``kernel_kwargs`` writes this name).
_SOFTCAPPED = re.compile(r"softcapped_silu\(\s*(?P<gate>[^,()\s]+)\s*,\s*(?P<up>[^,()\s]+)\s*\)")
# Activations of experts without a gate: a = act(up) (transformers' ``has_gate=False``). "relu2" is
# transformers' ReLUSquaredActivation, relu(up)^2 (Nemotron-H).
UNGATED = ("relu2",)


def softcapped(gate_cap: float, up_cap: float) -> str:
    """The ``activation`` of the softcapped SwiGLU with these caps (positive, finite)."""
    caps = (float(gate_cap), float(up_cap))
    if not all(0 < c < math.inf for c in caps):
        raise ValueError(f"softcapped_silu: the caps must be positive finite numbers, got {gate_cap}, {up_cap}")
    return f"softcapped_silu({caps[0]!r}, {caps[1]!r})"


def parse_activation(activation: str) -> tuple[str, tuple[float, ...]]:
    """(name, constants) of an ``activation``: ("silu", ()), ..., ("softcapped_silu", (gate_cap, up_cap)) (spaces
    inside the parentheses as one likes).

    Raises ValueError for a name that is none of ``ACTIVATIONS`` and no softcapped one, or softcap constants that
    are not positive finite numbers."""
    if activation in ACTIVATIONS:  # every op call asks: keep the common case cheap
        return activation, ()
    m = _SOFTCAPPED.fullmatch(activation) if isinstance(activation, str) else None
    if m is not None:
        try:
            caps = float(m["gate"]), float(m["up"])
        except ValueError:
            caps = ()
        if len(caps) == 2 and all(0 < c < math.inf for c in caps):
            return "softcapped_silu", caps
        raise ValueError(f"activation {activation!r}: the softcaps must be positive finite numbers")
    raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)} or softcapped_silu(gate_cap, up_cap) "
                     f"(reference.softcapped), got {activation!r}")


def softcaps(activation: str) -> tuple[float, float] | None:
    """(gate_cap, up_cap) of a softcapped SwiGLU's ``activation``, else None."""
    name, caps = parse_activation(activation)
    return caps if name == "softcapped_silu" else None


def gated(activation: str) -> bool:
    """Whether experts with this activation have a gate (W_gate_up [E, 2I, H]) or an up projection only
    (W_gate_up [E, I, H])."""
    return activation not in UNGATED


def ungated_act(up, activation: str = "relu2"):
    """act(up) of experts without a gate, spelled as transformers spells it (in up's dtype)."""
    return torch.square(F.relu(up))


def ungated_act_grad(up, activation: str = "relu2"):
    """d act(up) / d up, in up's dtype: 2 relu(up)."""
    return 2.0 * F.relu(up)

# gelu with the tanh approximation is x * sigmoid(GELU_C * (x + GELU_A * x^3)): 0.5 * (1 + tanh(z)) = sigmoid(2z).
GELU_A = 0.044715
GELU_C = 2.0 * math.sqrt(2.0 / math.pi)


def glu(gate, up, alpha: float | None, activation: str = "silu"):
    """silu(gate) * up; with ``alpha`` the GPT-OSS-style gate (MiniMax-M3-VL, GPT-OSS):
    gate * sigmoid(gate * alpha) * (up + 1), spelled as transformers spells it; with ``activation``
    "gelu_tanh" GeGLU, gelu(gate, approximate="tanh") * up (Gemma 4); with ``softcapped(Cg, Cu)`` Inkling 2's
    softcapped SwiGLU, Cg tanh(gate / Cg) * sigmoid(gate) * Cu tanh(up / Cu), in fp32 (or wider) and cast back."""
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    caps = softcaps(activation)
    if caps is not None:
        ct = torch.promote_types(gate.dtype, torch.float32)
        g, u = gate.to(ct), up.to(ct)
        gate_cap, up_cap = caps
        glu_ = torch.tanh(g / gate_cap) * gate_cap * torch.sigmoid(g) * (torch.tanh(u / up_cap) * up_cap)
        return glu_.to(gate.dtype)
    if alpha is None:
        return F.silu(gate) * up
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


def _gate_slope(gate, alpha: float | None, activation: str):
    """(u, du/dgate) of the gate written as gate * sigmoid(u): u = gate (silu), alpha * gate, or
    GELU_C * (gate + GELU_A * gate^3) (gelu_tanh)."""
    if activation == "gelu_tanh":
        return GELU_C * (gate + GELU_A * gate**3), GELU_C * (1 + 3 * GELU_A * gate**2)
    a = 1.0 if alpha is None else alpha
    return a * gate, a


def _gate_terms(gate, up, alpha: float | None, activation: str):
    """(act, d act / d gate, up_term, d up_term / d up) of ``glu`` = act(gate) * up_term(up), in gate's dtype."""
    caps = softcaps(activation)
    if caps is not None:  # act = Cg tanh(gate / Cg) sigmoid(gate), up_term = Cu tanh(up / Cu)
        gate_cap, up_cap = caps
        tg, tu, sig = torch.tanh(gate / gate_cap), torch.tanh(up / up_cap), torch.sigmoid(gate)
        act = gate_cap * tg * sig
        return act, sig * (1 - tg * tg) + act * (1 - sig), up_cap * tu, 1 - tu * tu
    u, du = _gate_slope(gate, alpha, activation)
    sig = torch.sigmoid(u)
    up_term = up if alpha is None else up + 1
    return gate * sig, sig * (1 + du * gate * (1 - sig)), up_term, 1


def split_gate_up(h, interleaved: bool = False):
    """(gate, up) of gate_up rows: the two halves, or with ``interleaved`` (GPT-OSS) the even and odd columns."""
    return (h[..., ::2], h[..., 1::2]) if interleaved else h.chunk(2, dim=-1)


def join_gate_up(gate, up, interleaved: bool = False):
    """The inverse of ``split_gate_up``."""
    return torch.stack([gate, up], dim=-1).flatten(-2) if interleaved else torch.cat([gate, up], dim=-1)


def experts_forward(x, ids, weights, w_gate_up, w_down, save_h: bool = False, swiglu_limit: float | None = None,
                    glu_alpha: float | None = None, activation: str = "silu", gate_up_bias=None,
                    interleaved: bool = False):
    """y[t] = sum_j weights[t,j] * W_down[e] (silu(W_gate[e] x[t]) * W_up[e] x[t]),  e = ids[t,j].

    swiglu_limit L: gate and up are clamped first (gate at max L, up to [-L, L]), as transformers does.
    glu_alpha, activation: the gated activation is ``glu(gate, up, glu_alpha, activation)``.
    gate_up_bias [E, 2I]: added to each row's gate_up output (in the weights' dtype, as transformers' add_).
    interleaved: gate and up are the even and odd rows of W_gate_up (GPT-OSS), not its two halves.

    Rounds like transformers' grouped_mm path: each GEMM in the weights' dtype,
    the routing weight applied with type promotion, the sum over k, then a cast to x.dtype.
    An ``UNGATED`` activation: y[t] = sum_j weights[t,j] * W_down[e] act(W_up[e] x[t]), W_up = w_gate_up [E, I, H].

    A slot whose id is an expert-parallel sentinel (>= E) adds nothing whatever its weight, NaN and inf
    included, as the kernels skip it: transformers' expert-parallel dispatch hands the experts weight 0
    at those slots (``masked_fill(off_rank, 0.0)``), and its batched_mm experts mask the weight to 0
    there too; only its grouped_mm spelling multiplies the zeroed row by the weight, which a NaN or inf
    weight (never passed by transformers) would turn into NaN.

    ``save_h`` also returns h [S, 2I] ([S, I] ungated), the pre-activation gate | up of each row in
    ``expert_order`` (sentinel rows zero; without the bias), the layout the Triton backward reads.
    """
    T, H = x.shape
    k = ids.shape[1]
    limit = limit_in(w_gate_up.dtype, swiglu_limit)
    order, counts = expert_order(ids, w_gate_up.shape[0])
    xs = x[order // k].to(w_gate_up.dtype)
    ys = torch.zeros(xs.shape[0], w_down.shape[1], dtype=w_down.dtype, device=x.device)
    h = torch.zeros(xs.shape[0], w_gate_up.shape[1], dtype=w_gate_up.dtype, device=x.device) if save_h else None
    for e, rows in _expert_slices(counts):
        h_rows = xs[rows] @ w_gate_up[e].t()
        if save_h:
            h[rows] = h_rows
        if gate_up_bias is not None:
            h_rows = h_rows + gate_up_bias[e].to(h_rows.dtype)
        if not gated(activation):
            ys[rows] = ungated_act(h_rows, activation) @ w_down[e].t()
            continue
        gate, up = clamp_gate_up(*split_gate_up(h_rows, interleaved), limit)
        ys[rows] = glu(gate, up, glu_alpha, activation) @ w_down[e].t()
    y_slots = torch.empty_like(ys)
    y_slots[order] = ys
    w = weights.reshape(-1, 1).masked_fill(ids.reshape(-1, 1) >= w_gate_up.shape[0], 0)  # sentinels add nothing
    weighted = y_slots * w
    y = weighted.view(T, k, H).sum(dim=1).to(x.dtype)
    return (y, h) if save_h else y


def experts_backward(dy, x, ids, weights, w_gate_up, w_down, swiglu_limit: float | None = None,
                     glu_alpha: float | None = None, activation: str = "silu", gate_up_bias=None,
                     interleaved: bool = False):
    """Gradients of experts_forward w.r.t. (x, weights, w_gate_up, w_down), accumulated in fp32; with
    gate_up_bias, (..., d_gate_up_bias) as well.

    With swiglu_limit, a clamped gate or up value passes no gradient (eager's clamp backward: the
    bound itself passes).

    Recomputes the expert activations instead of saving them. The sum over the k
    slots of each token is a fixed-order reduction (no scatter-add), so results
    are deterministic.
    """
    T, H = x.shape
    k = ids.shape[1]
    E = w_gate_up.shape[0]
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    limit = limit_in(w_gate_up.dtype, swiglu_limit)
    order, counts = expert_order(ids, E)
    token = order // k
    xs = x[token].to(ct)
    dys = dy[token].to(ct)
    ws = weights.reshape(-1)[order].to(ct)
    wgu = w_gate_up.to(ct)
    wd = w_down.to(ct)

    dx_rows = torch.zeros_like(xs)
    dw_rows = torch.zeros(xs.shape[0], dtype=ct, device=x.device)
    d_wgu = torch.zeros_like(wgu)
    d_wd = torch.zeros_like(wd)
    d_bias = None if gate_up_bias is None else torch.zeros(gate_up_bias.shape, dtype=ct, device=x.device)
    for e, rows in _expert_slices(counts):
        h = xs[rows] @ wgu[e].t()
        if gate_up_bias is not None:
            h = h + gate_up_bias[e].to(ct)
        if not gated(activation):
            a = ungated_act(h, activation)
            y = a @ wd[e].t()
            dw_rows[rows] = (dys[rows] * y).sum(dim=-1)
            d_y = dys[rows] * ws[rows, None]
            d_wd[e] = d_y.t() @ a
            d_h = (d_y @ wd[e]) * ungated_act_grad(h, activation)
            d_wgu[e] = d_h.t() @ xs[rows]
            dx_rows[rows] = d_h @ wgu[e]
            continue
        raw_gate, raw_up = split_gate_up(h, interleaved)
        gate, up = clamp_gate_up(raw_gate, raw_up, limit)
        act, d_act, up_term, d_up_term = _gate_terms(gate, up, glu_alpha, activation)
        a = act * up_term
        y = a @ wd[e].t()
        dw_rows[rows] = (dys[rows] * y).sum(dim=-1)
        d_y = dys[rows] * ws[rows, None]
        d_wd[e] = d_y.t() @ a
        d_a = d_y @ wd[e]
        d_gate = d_a * up_term * d_act
        d_up = d_a * act * d_up_term
        if limit is not None:
            d_gate = d_gate * (raw_gate <= limit)
            d_up = d_up * ((raw_up >= -limit) & (raw_up <= limit))
        d_h = join_gate_up(d_gate, d_up, interleaved)
        if d_bias is not None:
            d_bias[e] = d_h.sum(dim=0)
        d_wgu[e] = d_h.t() @ xs[rows]
        dx_rows[rows] = d_h @ wgu[e]

    dx_slots = torch.empty_like(dx_rows)
    dx_slots[order] = dx_rows
    d_weights = torch.empty_like(dw_rows)
    d_weights[order] = dw_rows
    grads = (
        dx_slots.view(T, k, H).sum(dim=1).to(x.dtype),
        d_weights.view(T, k).to(weights.dtype),
        d_wgu.to(w_gate_up.dtype),
        d_wd.to(w_down.dtype),
    )
    return grads if d_bias is None else (*grads, d_bias.to(gate_up_bias.dtype))


def down_bias_term(ids, weights, down_bias, num_experts: int):
    """sum_j weights[t, j] * down_bias[ids[t, j]] [T, H] in down_bias's dtype: what an expert's down bias adds to y
    (GPT-OSS).

    As one GEMM of the routing weights scattered into a dense [T, E] matrix, so autograd's backward is
    deterministic GEMMs and a gather (no scatter-add over tokens); a slot with an id >= E (an expert-parallel
    sentinel) adds nothing, as in transformers. Traceable by torch.fx (num_experts is a plain int)."""
    dense = weights.new_zeros(weights.shape[0], num_experts + 1, dtype=down_bias.dtype)
    dense = dense.scatter_add(1, ids.clamp(max=num_experts), weights.to(down_bias.dtype))
    return dense[:, :num_experts] @ down_bias
