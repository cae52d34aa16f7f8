"""``moe_fuse`` as a transformers experts implementation, for eager mode (no torch.compile).

    import moe_fuse
    moe_fuse.register_experts_implementation()
    model.set_experts_implementation("moe_fuse")     # or from_pretrained(..., experts_implementation="moe_fuse")

registers a forward ``(self, hidden_states, top_k_index, top_k_weights) -> Tensor``
in transformers' ``ALL_EXPERTS_FUNCTIONS``. On an experts module with the
standard layout (gate_up [E, 2I, H] with the gate rows first or interleaved with the up rows
(``is_concatenated=False``), down [E, H, I], or both stored transposed: ``is_transposed``;
optionally a bias per expert on each (``has_bias``); silu or tanh-approximated gelu; or without a gate
(``has_gate=False``: an up projection [E, I, H] and a squared ReLU, Nemotron-H); no post-expert
norm, transformers' own gating, its clamped SwiGLU (``swiglu_limit``) or the GPT-OSS-style gate
on those clamps (``swiglu_alpha``)) it is one ``torch.ops.moe_fuse.experts`` call, forward and
backward (with biases, ``ops.experts_with_biases``: the op and a small GEMM for the down bias). Any other module runs transformers' ``grouped_mm`` forward instead, with a warning (once
per module class and reason) that says why.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from ..spec import Epilogue

NAME = "moe_fuse"

_warned: set[tuple[str, str]] = set()


def _is_silu(act) -> bool:
    from transformers.activations import SiLUActivation

    return act is F.silu or type(act) in (SiLUActivation, torch.nn.SiLU)


_PROVEN_ACTIVATIONS: dict = {}


def _proved(act, name: str, want_fn) -> bool:
    """Whether ``act`` computes ``want_fn`` (the activation the op calls ``name``) on a float32 CPU probe; once per
    activation type and repr."""
    key = (name, type(act), repr(act))
    if key not in _PROVEN_ACTIVATIONS:
        probe = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 4
        try:
            got = act(probe)
        except Exception:  # an activation that cannot run on a float32 CPU probe is no proven match
            got = None
        want = want_fn(probe)
        _PROVEN_ACTIVATIONS[key] = isinstance(got, torch.Tensor) and got.shape == want.shape and \
            got.dtype == want.dtype and bool(torch.allclose(got, want, rtol=1e-6, atol=1e-6))
    return _PROVEN_ACTIVATIONS[key]


def activation_of(act) -> str | None:
    """The op's ``activation`` for an experts module's ``act_fn``: "silu", "gelu_tanh" (transformers'
    ``gelu_pytorch_tanh``, ``nn.GELU(approximate="tanh")``: proved on a probe), or None for anything else."""
    if _is_silu(act):
        return "silu"
    return "gelu_tanh" if _proved(act, "gelu_tanh", lambda p: F.gelu(p, approximate="tanh")) else None


def ungated_activation_of(act) -> str | None:
    """The op's ``activation`` for the ``act_fn`` of experts without a gate: "relu2" (transformers'
    ReLUSquaredActivation: relu(x)^2, proved on a probe), or None for anything else."""
    return "relu2" if _proved(act, "relu2", lambda p: torch.square(F.relu(p))) else None


def experts_epilogue(module) -> Epilogue | None:
    """The op's epilogue for ``module`` (its activation, constants and gate/up row order), or None when its gate is
    none the op computes."""
    from transformers.integrations.moe import _default_apply_gate

    if not getattr(module, "has_gate", True):  # an up projection only
        act = ungated_activation_of(getattr(module, "act_fn", None))
        return None if act is None else _plain(act)
    if getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        return gate_epilogue(module)
    act = activation_of(getattr(module, "act_fn", None))
    return None if act is None else _plain(act)


@functools.cache
def _plain(activation: str) -> Epilogue:
    """``Epilogue(activation)``, made once (every forward asks)."""
    return Epilogue(activation)


def unsupported_reason(module) -> str | None:
    """Why ``module`` cannot run as ``torch.ops.moe_fuse.experts``; None when it can."""
    from transformers.integrations.moe import _default_apply_gate

    if not hasattr(module, "has_gate"):
        return "no has_gate attribute (not transformers' experts interface)"
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert"
    if not module.has_gate:
        return _ungated_reason(module)
    if getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        if gate_epilogue(module) is None:
            return f"a custom gating function ({type(module).__name__}._apply_gate)"
    elif activation_of(getattr(module, "act_fn", None)) is None:
        return f"activation {type(getattr(module, 'act_fn', None)).__name__}, not silu or tanh-approximated gelu"
    missing = _missing_3d(module, "gate_up_proj", "down_proj")
    if missing:
        return missing
    w_gate_up, w_down = _op_weights(module)
    E, two_i, H = w_gate_up.shape
    if two_i % 2 or tuple(w_down.shape) != (E, H, two_i // 2):
        layout = "[E, H, 2I] and [E, I, H]" if getattr(module, "is_transposed", False) else "[E, 2I, H] and [E, H, I]"
        return f"gate_up_proj {tuple(module.gate_up_proj.shape)} and down_proj {tuple(module.down_proj.shape)} " \
               f"are not {layout}"
    if getattr(module, "has_bias", False):
        for name, shape in (("gate_up_proj_bias", (E, two_i)), ("down_proj_bias", (E, H))):
            b = getattr(module, name, None)
            if not isinstance(b, torch.Tensor) or tuple(b.shape) != shape:
                got = f"of shape {list(b.shape)}" if isinstance(b, torch.Tensor) else "missing"
                return f"expert biases whose {name} is {got}, not a {list(shape)} tensor"
    return None


def _missing_3d(module, *names) -> str | None:
    """The reason when one of the named expert weights is not a 3-D tensor, else None."""
    for name in names:
        w = getattr(module, name, None)
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            return f"no 3-D {name} parameter"
    return None


def _ungated_reason(module) -> str | None:
    """``unsupported_reason`` of experts without a gate (an up projection only: Nemotron-H)."""
    act = getattr(module, "act_fn", None)
    if ungated_activation_of(act) is None:
        return f"no gate and activation {type(act).__name__}, not a squared ReLU"
    if getattr(module, "has_bias", False):
        return "no gate and a bias per expert (not fused yet)"
    missing = _missing_3d(module, "up_proj", "down_proj")
    if missing:
        return missing
    w_up, w_down = _op_weights(module)
    E, I, H = w_up.shape
    if tuple(w_down.shape) != (E, H, I):
        layout = "[E, H, I] and [E, I, H]" if getattr(module, "is_transposed", False) else "[E, I, H] and [E, H, I]"
        return f"up_proj {tuple(module.up_proj.shape)} and down_proj {tuple(module.down_proj.shape)} are not {layout}"
    return None


def _interleaved(module) -> bool:
    """gate and up rows alternate in gate_up_proj: transformers' ``is_concatenated=False`` (GPT-OSS) on a module
    with a gate of its own, which ``gate_epilogue`` proves on that split (transformers' default gate always takes the
    two halves, whatever the flag says)."""
    from transformers.integrations.moe import _default_apply_gate

    custom = getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate
    return custom and not getattr(module, "is_concatenated", True)


def _op_weights(module):
    """(W_gate_up [E, 2I, H] (W_up [E, I, H] without a gate), W_down [E, H, I]) as the op takes them: views of
    weights stored transposed."""
    first = module.gate_up_proj if getattr(module, "has_gate", True) else module.up_proj
    if getattr(module, "is_transposed", False):
        return first.transpose(-2, -1), module.down_proj.transpose(-2, -1)
    return first, module.down_proj


_PROVEN_GATES: dict = {}


def _number(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < float("inf")
    return float(value) if ok else None


def gate_epilogue(module) -> Epilogue | None:
    """The op's epilogue for ``module._apply_gate``, proved on a probe; None when it is none of these (each with
    ``interleaved`` where gate and up rows alternate: ``_interleaved``):

    - ``Epilogue(swiglu_limit=L)``: transformers' clamped SwiGLU, silu(gate.clamp(max=L)) * up.clamp(-L, L)
      (GLM-5-Next, HY-V4, DeepSeek-V4: the bound in ``swiglu_limit`` or ``limit``);
    - ``Epilogue(swiglu_limit=L, glu_alpha=a)``: the GPT-OSS-style gate after those clamps,
      gate * sigmoid(a * gate) * (up + 1) (MiniMax-M3-VL: ``swiglu_alpha``; GPT-OSS: ``alpha``);
    - ``Epilogue()``: plain silu(gate) * up, computed in fp32 and cast back (Beam), what the kernels compute anyway;
    - ``Epilogue("softcapped_silu", gate_cap=Cg, up_cap=Cu)``: Inkling 2's softcapped SwiGLU,
      Cg tanh(gate / Cg) * sigmoid(gate) * Cu tanh(up / Cu) (the caps in ``act_fn.gate_softcap.softcap`` and
      ``act_fn.up_softcap.softcap``).

    The probe has values past the bound; it runs once per class, gate function and constants (a re-bound
    gate is proved again). A gate that only looks like one of these does not pass.
    """
    from ..reference import clamp_gate_up, glu, split_gate_up

    limit = _number(getattr(module, "swiglu_limit", None))
    limit = _number(getattr(module, "limit", None)) if limit is None else limit
    limit = limit if limit is not None and limit > 0 else None
    alpha = _number(getattr(module, "swiglu_alpha", None))
    alpha = _number(getattr(module, "alpha", None)) if alpha is None else alpha  # GPT-OSS's name for it
    interleaved = _interleaved(module)
    act = getattr(module, "act_fn", None)
    caps = tuple(_number(getattr(getattr(act, f"{half}_softcap", None), "softcap", None)) for half in ("gate", "up"))
    caps = caps if all(c is not None and c > 0 for c in caps) else None
    # act_fn's modules and their forwards are part of what is proved (the softcapped gate calls them)
    act_code = tuple((type(m), getattr(type(m), "forward", None)) for m in act.modules()) \
        if isinstance(act, torch.nn.Module) else type(act)
    key = (type(module), getattr(type(module), "_apply_gate", None), limit, alpha, interleaved, caps, act_code)
    if key not in _PROVEN_GATES:
        # float32: a gate that upcasts computes in float32 whatever it is given (Beam's .float())
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn(64, 16, generator=gen) * (2 * (limit or 1.0))
        try:
            got = module._apply_gate(probe)
        except Exception:  # a gate that cannot run on a float32 CPU probe is no proven match
            got = None
        plain = Epilogue(interleaved=interleaved)
        candidates = [(plain, glu(*split_gate_up(probe, interleaved), None))]
        if limit is not None:
            gate, up = clamp_gate_up(*split_gate_up(probe, interleaved), limit)
            candidates += [(Epilogue(swiglu_limit=limit, interleaved=interleaved), glu(gate, up, None))]
            if alpha is not None:
                candidates += [(Epilogue(swiglu_limit=limit, glu_alpha=alpha, interleaved=interleaved),
                                glu(gate, up, alpha))]
        if caps is not None:
            capped = Epilogue("softcapped_silu", gate_cap=caps[0], up_cap=caps[1], interleaved=interleaved)
            candidates += [(capped, glu(*split_gate_up(probe, interleaved), None, capped.kernel_activation))]
        _PROVEN_GATES[key] = None
        for epilogue, want in candidates:
            if isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype and bool(
                torch.allclose(got, want, rtol=1e-6, atol=1e-6)
            ):
                _PROVEN_GATES[key] = epilogue
                break
    return _PROVEN_GATES[key]


def _warn_once(module, reason: str):
    key = (type(module).__name__, reason)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(
        f"moe_fuse experts implementation: {type(module).__name__} has {reason}, which "
        "torch.ops.moe_fuse.experts does not compute; running transformers' grouped_mm forward instead.",
        stacklevel=3,
    )


def moe_fuse_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    reason = unsupported_reason(self)
    if reason is not None:
        from transformers.integrations.moe import grouped_mm_experts_forward

        _warn_once(self, reason)
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    from .. import ops  # (registers torch.ops.moe_fuse)

    args = (hidden_states, top_k_index, top_k_weights, *_op_weights(self))
    biases = (self.gate_up_proj_bias, self.down_proj_bias) if getattr(self, "has_bias", False) else (None, None)
    # Keep h for the backward only when there will be one (the op's docstring says why).
    save_h = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*args, *biases))
    epilogue = experts_epilogue(self).encode()
    if biases[0] is None and biases[1] is None:
        return torch.ops.moe_fuse.experts(*args, save_h, epilogue)[0]
    return ops.experts_with_biases(*args, *biases, save_h, epilogue)


def register_experts_implementation(name: str = NAME) -> str:
    """Register the moe_fuse experts forward with transformers under ``name``; returns the name.

    Afterwards ``model.set_experts_implementation(name)`` (or
    ``from_pretrained(..., experts_implementation=name)``) runs every standard
    experts module as one fused op. Calling it again is harmless.
    """
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(name, moe_fuse_experts_forward)
    return name
