"""What a matched MoE block computes: plain data handed from describe to verify and rewrite."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import asdict, dataclass, fields

import torch

from . import reference

# --------------------------------------------------------------------------- the experts' epilogue

EPILOGUE_ACTIVATIONS = ("silu", "gelu_tanh", "relu2", "softcapped_silu")
_ENCODED = re.compile(r"(?P<name>[a-z0-9_]+)(?:\((?P<params>[^()]*)\))?")


def _number(name: str, value) -> float | None:
    """value as a float (None stays None); anything but an int or a float is an error."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value) + 0.0  # -0.0 as 0.0: one value, one encoding


@dataclass(frozen=True)
class Epilogue:
    """What the experts compute between their two GEMMs, from the gate_up output h to the down GEMM's input.

    activation:
      "silu"             SwiGLU, silu(gate) * up;
      "gelu_tanh"        GeGLU, gelu(gate, approximate="tanh") * up (Gemma 4);
      "softcapped_silu"  Inkling 2's softcapped SwiGLU, Cg tanh(gate / Cg) * sigmoid(gate) * Cu tanh(up / Cu) in
                         fp32, with Cg = ``gate_cap`` and Cu = ``up_cap`` (both required, positive and finite);
      "relu2"            experts without a gate (Nemotron-H): W_gate_up is an up projection [E, I, H] and the
                         activation relu(up)^2; none of the gate options below.
    swiglu_limit L: gate.clamp(max=L) and up.clamp(-L, L) first (transformers' clamped SwiGLU).
    glu_alpha a (silu only): the GPT-OSS-style gate, gate * sigmoid(a * gate) * (up + 1), after the clamps if any.
    interleaved: gate and up are the even and odd rows of W_gate_up (GPT-OSS), not its two halves.

    The op takes it as one string, ``encode()``, and reads it back with ``Epilogue.decode``: a custom op's schema
    carries primitives only. The encoding is exact (floats as their shortest round-tripping repr) and canonical
    (one string per value: the activation, then its non-default fields in field order), so plain SwiGLU is "silu"
    and ``decode(e.encode()) == e``. Bad values raise ValueError naming the problem.
    """

    activation: str = "silu"
    gate_cap: float | None = None
    up_cap: float | None = None
    swiglu_limit: float | None = None
    glu_alpha: float | None = None
    interleaved: bool = False

    def __post_init__(self):
        act = self.activation
        if act not in EPILOGUE_ACTIVATIONS:
            raise ValueError(f"activation must be one of silu, gelu_tanh, relu2 or softcapped_silu (with gate_cap "
                             f"and up_cap), got {act!r}")
        for name in ("gate_cap", "up_cap", "swiglu_limit", "glu_alpha"):
            object.__setattr__(self, name, _number(name, getattr(self, name)))
        if not isinstance(self.interleaved, bool):
            raise ValueError(f"interleaved must be a bool, got {self.interleaved!r}")
        caps = (self.gate_cap, self.up_cap)
        if act == "softcapped_silu":
            if not all(c is not None and 0 < c < math.inf for c in caps):
                raise ValueError(f"softcapped_silu: the caps must be positive finite numbers, got {caps[0]}, "
                                 f"{caps[1]}")
        elif caps != (None, None):
            raise ValueError(f"gate_cap and up_cap are the caps of softcapped_silu; activation {act!r} has none")
        if self.glu_alpha is not None and act != "silu":
            raise ValueError(f"glu_alpha is a gate of its own; it does not combine with {act!r}")
        if self.swiglu_limit is not None and not (0 < self.swiglu_limit < math.inf):
            raise ValueError(f"swiglu_limit must be a positive finite number, got {self.swiglu_limit}")
        if self.glu_alpha is not None and not (abs(self.glu_alpha) < math.inf):
            raise ValueError(f"glu_alpha must be a finite number, got {self.glu_alpha}")
        if not self.gated and (self.swiglu_limit is not None or self.glu_alpha is not None or self.interleaved):
            raise ValueError(f"activation {act!r} has no gate; swiglu_limit, glu_alpha, gate_up_bias and "
                             "interleaved are gate options")

    @property
    def gated(self) -> bool:
        """Whether the experts have a gate (W_gate_up [E, 2I, H]) or an up projection only ([E, I, H])."""
        return self.activation not in reference.UNGATED

    @property
    def softcaps(self) -> tuple[float, float] | None:
        """(gate_cap, up_cap) of the softcapped SwiGLU, else None."""
        return (self.gate_cap, self.up_cap) if self.activation == "softcapped_silu" else None

    @functools.cached_property
    def kernel_activation(self) -> str:
        """The ``activation`` argument of the kernels and of ``reference``: the name, or for the softcapped SwiGLU
        ``reference.softcapped(gate_cap, up_cap)``."""
        caps = self.softcaps
        return self.activation if caps is None else reference.softcapped(*caps)

    def kernel_kwargs(self, gate_up_bias=None) -> dict:
        """The keyword arguments of ``dispatch.experts_forward`` / ``experts_backward``, ``reference``'s and the
        kernels' for this epilogue: swiglu_limit, glu_alpha, activation, gate_up_bias, interleaved."""
        return {"swiglu_limit": self.swiglu_limit, "glu_alpha": self.glu_alpha, "activation": self.kernel_activation,
                "gate_up_bias": gate_up_bias, "interleaved": self.interleaved}

    @classmethod
    def from_kernel_args(cls, swiglu_limit: float | None = None, glu_alpha: float | None = None,
                         activation: str = "silu", interleaved: bool = False) -> Epilogue:
        """The epilogue of the kernels' keyword arguments (``activation`` as they take it: the softcapped SwiGLU
        as ``reference.softcapped(Cg, Cu)``); the inverse of ``kernel_kwargs``."""
        name, caps = reference.parse_activation(activation)
        gate_cap, up_cap = caps if caps else (None, None)
        return cls(name, gate_cap, up_cap, swiglu_limit, glu_alpha, interleaved)

    def encode(self) -> str:
        """The canonical string of this epilogue (``decode``'s input): "silu", "gelu_tanh", "relu2" or
        ``name(field=value, ...)`` with the fields that differ from their defaults, in field order, e.g.
        "silu(swiglu_limit=7.0, glu_alpha=1.702, interleaved=True)"."""
        return self._encoded

    @functools.cached_property
    def _encoded(self) -> str:
        params = []
        for f in fields(self)[1:]:
            value = getattr(self, f.name)
            if value != f.default:
                params.append(f"{f.name}={value!r}")
        return f"{self.activation}({', '.join(params)})" if params else self.activation

    @staticmethod
    def decode(encoded: str) -> Epilogue:
        """The Epilogue whose ``encode()`` is ``encoded``; ValueError for anything else (a string that is no
        encoding, not the canonical one, or of bad values). Cached: a repeated string costs a dict lookup."""
        return _decode(encoded)

    def __str__(self) -> str:
        return self.encode()


@functools.lru_cache(maxsize=1024)
def _decode(encoded: str) -> Epilogue:
    if not isinstance(encoded, str):
        raise ValueError(f"an epilogue is a string (Epilogue.encode), got {type(encoded).__name__}")
    m = _ENCODED.fullmatch(encoded)
    if m is None:
        raise ValueError(f"epilogue {encoded!r} is not an Epilogue encoding: name or name(field=value, ...), "
                         "as Epilogue.encode writes it")
    kwargs = {}
    numbers = {"gate_cap", "up_cap", "swiglu_limit", "glu_alpha"}
    for item in m["params"].split(", ") if m["params"] else ():
        key, eq, value = item.partition("=")
        if not eq or (key not in numbers and key != "interleaved") or key in kwargs:
            raise ValueError(f"epilogue {encoded!r}: {item!r} is not one of the fields gate_cap, up_cap, "
                             "swiglu_limit, glu_alpha, interleaved (field=value, once each)")
        if key == "interleaved":
            if value != "True":
                raise ValueError(f"epilogue {encoded!r}: interleaved is written interleaved=True or left out")
            kwargs[key] = True
            continue
        try:
            kwargs[key] = float(value)
        except ValueError:
            raise ValueError(f"epilogue {encoded!r}: {key}={value} is not a number") from None
    try:
        epilogue = Epilogue(m["name"], **kwargs)
    except ValueError as e:
        raise ValueError(f"epilogue {encoded!r}: {e}") from None
    if epilogue.encode() != encoded:
        raise ValueError(f"epilogue {encoded!r} is not in canonical form; it is written {epilogue.encode()!r}")
    return epilogue

# --------------------------------------------------------------------------- matched blocks


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
    """Gated experts over [E, 2I, H] gate_up (gate rows first, or interleaved with the up rows) and [E, H, I] down
    weights, computing ``epilogue`` between the GEMMs; or experts without a gate (``layout="up_only"``, the
    epilogue's activation "relu2": an [E, I, H] up projection and a squared ReLU, Nemotron-H)."""

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    dtype: torch.dtype  # of the hidden states
    weights_dtype: torch.dtype  # of the routing weights
    epilogue: Epilogue = Epilogue()  # the activation, its constants, the clamps, the gate/up row order
    layout: str = "gate_up_concat"
    expert_parallel_sentinels: bool = False  # transformers' EP masking ops were present
    # GPT-OSS: a bias per expert on the gate_up and on the down projection
    gate_up_bias: bool = False
    down_bias: bool = False

    def to_json(self) -> dict:
        """The fields, the epilogue's among them (activation, gate_cap, up_cap, swiglu_limit, glu_alpha,
        interleaved), and the op's string of it as ``epilogue``."""
        d = asdict(self)
        d.update(d.pop("epilogue"), epilogue=self.epilogue.encode())
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
