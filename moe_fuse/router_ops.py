"""Fused ops for the router spellings beyond softmax -> top-k, with their plain-PyTorch math.

- ``moe_fuse::router_sigmoid`` (DeepSeek-V3 and the families that copy its router: GLM-4.5, dots1,
  Kimi, ...): sigmoid scores of fp32 logits; a correction bias added for the selection only;
  optional group-limited selection (the top-2 sum of each group ranks the groups, the best
  ``topk_group`` groups stay, the rest are masked to -inf); top-k of the biased scores; the
  unbiased scores of the chosen experts, optionally renormalised (``/ (sum + eps)``) and scaled.
- ``moe_fuse::router_topk_softmax`` (GPT-OSS, Granite-MoE, Aria style): linear (with or without a
  bias), top-k of the logits, softmax over the k values, optionally divided by a constant.

Both return (logits, routing weights, expert ids), logits included because the auxiliary loss
reads them. The forward runs the very torch ops the model code runs, in the same order (top-k with
the same ``sorted`` flag), so ids, their order and ties come out as in eager on every device; the
backward is written out (checked against float64 autograd in tests/test_router_ops.py) and runs
as one opaque op, like ``moe_fuse::router_backward``.

``logits_mode`` says how the logits are computed: "fp32_inputs" ``linear(x.float(), W.float())``
(also what a plain fp32 linear computes), "fp32_output" ``linear(x, W).float()``, "native"
``linear(x, W)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from typing import Optional

from torch import Tensor

LOGITS_MODES = ("fp32_inputs", "fp32_output", "native")

# --------------------------------------------------------------------------- math (CPU and CUDA)


def logits_forward(x, weight, bias, mode: str):
    if mode == "fp32_inputs":
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    logits = F.linear(x, weight, bias)
    return logits.float() if mode == "fp32_output" else logits


def logits_backward(d_logits, x, weight, bias, mode: str):
    """Gradients of logits_forward w.r.t. (x, weight, bias); bias's is None when there is none."""
    if mode == "fp32_inputs":
        g = d_logits.float()
        dx = (g @ weight.float()).to(x.dtype)
        dw = (g.t() @ x.float()).to(weight.dtype)
    else:  # the linear ran in x's dtype; the upcast's gradient casts back to it
        g = d_logits.to(x.dtype)
        dx = g @ weight
        dw = g.t() @ x
    db = None if bias is None else g.sum(dim=0).to(bias.dtype)
    return dx, dw, db


def sigmoid_forward(x, weight, bias, top_k: int, n_group: int, topk_group: int, group_sorted: bool,
                    sorted: bool, renorm: bool, eps: float, scale: float, logits_mode: str,
                    weights_dtype: torch.dtype):
    """DeepSeek-V3 routing, op for op as transformers writes it. Returns (logits, weights, ids)."""
    logits = logits_forward(x, weight, None, logits_mode)
    scores = logits.sigmoid()
    choice = scores + bias
    if n_group > 1 and topk_group < n_group:
        T, E = choice.shape
        per_group = E // n_group
        group_scores = choice.view(T, n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, topk_group, dim=-1, sorted=group_sorted)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = keep.unsqueeze(-1).expand(T, n_group, per_group).reshape(T, E)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=sorted)[1]
    weights = scores.gather(1, ids)
    if renorm:
        total = weights.sum(dim=-1, keepdim=True)
        if eps != 0.0:
            total = total + eps
        weights = weights / total
    if scale != 1.0:
        weights = weights * scale
    return logits, weights.to(weights_dtype), ids


def sigmoid_backward(d_logits, d_weights, x, weight, logits, ids, renorm: bool, eps: float, scale: float,
                     logits_mode: str):
    """Gradients of sigmoid_forward w.r.t. x and weight (the bias only steers the selection: none)."""
    ct = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scores = logits.to(ct).sigmoid()
    d = d_weights.to(ct)
    if scale != 1.0:
        d = d * scale
    if renorm:
        values = scores.gather(1, ids)
        total = values.sum(dim=-1, keepdim=True) + eps
        # w_j = v_j / D, D = sum(v) + eps:  dv_i = (d_i - sum_j d_j v_j / D) / D
        d = (d - (d * values).sum(dim=-1, keepdim=True) / total) / total
    d_scores = torch.zeros_like(scores).scatter_(1, ids, d)
    d_logits = d_scores * scores * (1 - scores) + d_logits.to(ct)
    dx, dw, _ = logits_backward(d_logits, x, weight, None, logits_mode)
    return dx, dw


def topk_softmax_forward(x, weight, bias, top_k: int, logits_mode: str, softmax_dtype: torch.dtype,
                         divisor: float, weights_dtype: torch.dtype):
    """GPT-OSS routing: logits, top-k of the logits, softmax of the k values. Returns (logits, weights, ids)."""
    logits = logits_forward(x, weight, bias, logits_mode)
    values, ids = torch.topk(logits, top_k, dim=-1)
    weights = torch.softmax(values, dim=-1, dtype=softmax_dtype)
    if divisor != 1.0:
        weights = weights / divisor
    return logits, weights.to(weights_dtype), ids


def topk_softmax_backward(d_logits, d_weights, x, weight, bias, logits, ids, softmax_dtype: torch.dtype,
                          divisor: float, logits_mode: str):
    """Gradients of topk_softmax_forward w.r.t. (x, weight, bias)."""
    ct = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(logits.gather(1, ids), dim=-1, dtype=softmax_dtype).to(ct)
    d = d_weights.to(ct)
    if divisor != 1.0:
        d = d / divisor
    d_values = probs * (d - (d * probs).sum(dim=-1, keepdim=True))
    d_all = torch.zeros(logits.shape, dtype=ct, device=logits.device).scatter_(1, ids, d_values)
    return logits_backward(d_all + d_logits.to(ct), x, weight, bias, logits_mode)


# --------------------------------------------------------------------------- ops


def _check_mode(logits_mode: str):
    if logits_mode not in LOGITS_MODES:
        raise ValueError(f"moe_fuse router: logits_mode {logits_mode!r}, expected one of {LOGITS_MODES}")


def _fake_outputs(x, weight, top_k, logits_dtype, weights_dtype):
    T, E = x.shape[0], weight.shape[0]
    return (
        x.new_empty((T, E), dtype=logits_dtype),
        x.new_empty((T, top_k), dtype=weights_dtype),
        x.new_empty((T, top_k), dtype=torch.int64),
    )


def _logits_dtype(x, logits_mode):
    return x.dtype if logits_mode == "native" else torch.float32


def _contiguous(*tensors):
    return tuple(None if t is None else t.contiguous() for t in tensors)


# ----- sigmoid, grouped


@torch.library.custom_op("moe_fuse::router_sigmoid", mutates_args=())
def router_sigmoid(
    x: Tensor, weight: Tensor, bias: Tensor, top_k: int, n_group: int, topk_group: int, group_sorted: bool,
    sorted: bool, renorm: bool, eps: float, scale: float, logits_mode: str, weights_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    _check_mode(logits_mode)
    out = sigmoid_forward(x, weight, bias, top_k, n_group, topk_group, group_sorted, sorted, renorm, eps, scale,
                          logits_mode, weights_dtype)
    return _contiguous(*out)


@router_sigmoid.register_fake
def _(x, weight, bias, top_k, n_group, topk_group, group_sorted, sorted, renorm, eps, scale, logits_mode,
      weights_dtype):
    return _fake_outputs(x, weight, top_k, torch.float32, weights_dtype)


@torch.library.custom_op("moe_fuse::router_sigmoid_backward", mutates_args=())
def router_sigmoid_backward(
    d_logits: Tensor, d_weights: Tensor, x: Tensor, weight: Tensor, logits: Tensor, ids: Tensor, renorm: bool,
    eps: float, scale: float, logits_mode: str,
) -> tuple[Tensor, Tensor]:
    return _contiguous(*sigmoid_backward(d_logits, d_weights, x, weight, logits, ids, renorm, eps, scale,
                                         logits_mode))


@router_sigmoid_backward.register_fake
def _(d_logits, d_weights, x, weight, logits, ids, renorm, eps, scale, logits_mode):
    fmt = torch.contiguous_format
    return torch.empty_like(x, memory_format=fmt), torch.empty_like(weight, memory_format=fmt)


def _sigmoid_setup_context(ctx, inputs, output):
    x, weight, bias, top_k, n_group, topk_group, group_sorted, sorted, renorm, eps, scale, logits_mode, _ = inputs
    logits, _, ids = output
    ctx.save_for_backward(x, weight, logits, ids)
    ctx.args = (renorm, eps, scale, logits_mode)


def _sigmoid_backward(ctx, d_logits, d_weights, d_ids):
    x, weight, logits, ids = ctx.saved_tensors
    if d_logits is None:
        d_logits = torch.zeros_like(logits)
    if d_weights is None:
        d_weights = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    dx, dw = torch.ops.moe_fuse.router_sigmoid_backward(d_logits, d_weights, x, weight, logits, ids, *ctx.args)
    return (dx, dw) + (None,) * 11


router_sigmoid.register_autograd(_sigmoid_backward, setup_context=_sigmoid_setup_context)


# ----- top-k of the logits, then softmax


@torch.library.custom_op("moe_fuse::router_topk_softmax", mutates_args=())
def router_topk_softmax(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], top_k: int, logits_mode: str, softmax_dtype: torch.dtype,
    divisor: float, weights_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    _check_mode(logits_mode)
    out = topk_softmax_forward(x, weight, bias, top_k, logits_mode, softmax_dtype, divisor, weights_dtype)
    return _contiguous(*out)


@router_topk_softmax.register_fake
def _(x, weight, bias, top_k, logits_mode, softmax_dtype, divisor, weights_dtype):
    return _fake_outputs(x, weight, top_k, _logits_dtype(x, logits_mode), weights_dtype)


@torch.library.custom_op("moe_fuse::router_topk_softmax_backward", mutates_args=())
def router_topk_softmax_backward(
    d_logits: Tensor, d_weights: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], logits: Tensor,
    ids: Tensor, softmax_dtype: torch.dtype, divisor: float, logits_mode: str,
) -> list[Tensor]:
    """[dx, d_weight] or [dx, d_weight, d_bias] (a custom op cannot return an optional tensor)."""
    grads = topk_softmax_backward(d_logits, d_weights, x, weight, bias, logits, ids, softmax_dtype, divisor,
                                  logits_mode)
    return [g.contiguous() for g in grads if g is not None]


@router_topk_softmax_backward.register_fake
def _(d_logits, d_weights, x, weight, bias, logits, ids, softmax_dtype, divisor, logits_mode):
    fmt = torch.contiguous_format
    return [torch.empty_like(t, memory_format=fmt) for t in (x, weight, bias) if t is not None]


def _topk_softmax_setup_context(ctx, inputs, output):
    x, weight, bias, top_k, logits_mode, softmax_dtype, divisor, weights_dtype = inputs
    logits, weights, ids = output
    ctx.save_for_backward(x, weight, bias, logits, ids)
    ctx.args = (softmax_dtype, divisor, logits_mode)
    ctx.weights_dtype = weights_dtype


def _topk_softmax_backward(ctx, d_logits, d_weights, d_ids):
    x, weight, bias, logits, ids = ctx.saved_tensors
    if d_logits is None:
        d_logits = torch.zeros_like(logits)
    if d_weights is None:
        d_weights = torch.zeros(ids.shape, dtype=ctx.weights_dtype, device=ids.device)
    grads = torch.ops.moe_fuse.router_topk_softmax_backward(d_logits, d_weights, x, weight, bias, logits, ids,
                                                            *ctx.args)
    db = grads[2] if bias is not None else None
    return grads[0], grads[1], db, None, None, None, None, None


router_topk_softmax.register_autograd(_topk_softmax_backward, setup_context=_topk_softmax_setup_context)
