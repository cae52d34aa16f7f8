"""What a matched MoE block computes: plain data handed from describe to verify and rewrite."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class RouterSpec:
    """linear -> softmax(fp32) -> top-k -> optional renorm -> cast to ``weights_dtype``."""

    num_experts: int
    top_k: int
    hidden: int
    renorm: bool
    dtype: torch.dtype  # of the hidden states and router weight
    weights_dtype: torch.dtype  # of the routing weights handed to the experts
    scoring: str = "softmax"

    def to_json(self) -> dict:
        d = asdict(self)
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        d["weights_dtype"] = str(self.weights_dtype).removeprefix("torch.")
        return d


@dataclass(frozen=True)
class ExpertsSpec:
    """SwiGLU experts over [E, 2I, H] gate_up (gate rows first) and [E, H, I] down weights, optionally
    with gate and up clamped at ``swiglu_limit``; or experts without a gate (``layout="up_only"``,
    ``activation="relu2"``: an [E, I, H] up projection and a squared ReLU, Nemotron-H)."""

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    dtype: torch.dtype  # of the hidden states
    weights_dtype: torch.dtype  # of the routing weights
    # "silu" (SwiGLU); "gelu_tanh": GeGLU, gelu(gate, approximate="tanh") * up (Gemma 4); "relu2": no gate,
    # relu(up)^2 (Nemotron-H); ``reference.softcapped(Cg, Cu)``: the softcapped SwiGLU (Inkling 2)
    activation: str = "silu"
    layout: str = "gate_up_concat"
    expert_parallel_sentinels: bool = False  # transformers' EP masking ops were present
    # transformers' ``swiglu_limit`` (GLM-5-Next, HY-V4, MiniMax-M3-VL): silu(gate.clamp(max=L)) * up.clamp(-L, L)
    swiglu_limit: float | None = None
    # the GPT-OSS-style gate (MiniMax-M3-VL): gate * sigmoid(glu_alpha * gate) * (up + 1) instead of silu(gate) * up
    glu_alpha: float | None = None
    # GPT-OSS: a bias per expert on the gate_up and on the down projection
    gate_up_bias: bool = False
    down_bias: bool = False

    def to_json(self) -> dict:
        d = asdict(self)
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        d["weights_dtype"] = str(self.weights_dtype).removeprefix("torch.")
        return d


@dataclass(frozen=True)
class SigmoidRouterSpec(RouterSpec):
    """DeepSeek-V3 style: linear -> sigmoid -> + selection bias -> [group-limited] top-k -> gather the
    unbiased scores -> [renorm: / (sum + eps)] -> * scale -> cast to ``weights_dtype``."""

    n_group: int = 1
    topk_group: int = 1
    eps: float = 0.0
    scale: float = 1.0
    logits_mode: str = "fp32_inputs"  # how the logits are computed: see moe_fuse/router_ops.py


@dataclass(frozen=True)
class TopkSoftmaxRouterSpec(RouterSpec):
    """GPT-OSS style: linear [+ bias] -> top-k of the logits -> softmax of the k values -> [/ divisor] -> cast."""

    linear_bias: bool = False
    softmax_dtype: str = "float32"
    divisor: float = 1.0
    logits_mode: str = "native"
