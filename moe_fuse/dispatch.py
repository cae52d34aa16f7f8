"""Which kernels compute an experts call, and what its forward keeps for the backward: decided here, only here.

The op's real and fake implementations (ops.py), its autograd formula and the pattern passes all ask this
module. It reads shapes, dtypes, devices, strides and ``config``, never tensor values, so a traced graph and
the run agree on every output's size.

The kernel paths (docs/kernels.md):

    "grouped_mm"  kernels/grouped_mm_path.py, CUDA sm90+ and everything bf16: the GEMMs on expert-sorted rows
                  (torch._grouped_mm, or the Triton ragged GEMM from ``config.ragged_min_rows`` rows up), with
                  Triton kernels for the routing, the row copies, the activation and the combines. The training
                  forward (save_h) and backward, the gate_up bias, interleaved gate/up rows, experts without a
                  gate and the softcapped SwiGLU.
    "triton"      the portable path: kernels/forward.py and kernels/backward.py, fused Triton GEMMs that gather
                  their rows in the A-load and apply the activation in the epilogue (h never written). Any CUDA
                  GPU, bf16 / fp16 / fp32; on sm90 bf16 the forward that keeps nothing (inference, checkpointed
                  layers), where it is the faster one.
    "reference"   reference.py in PyTorch: CPU, and inputs the kernels do not take.

``experts_forward`` and ``experts_backward`` below run the kernel paths directly (the tests and benchmarks call
them); the op runs ``plan``'s choice. ``padded_attention_applies`` decides the attention-mask rewrite's kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import config
from .kernels import transposed
from .reference import gated, softcaps

_CAPABILITY: dict = {}


def _major(device) -> int:
    """The CUDA device's compute capability major, asked once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)[0]
    return _CAPABILITY[index]


def grouped_mm_applies(x, w_gate_up, w_down, *others) -> bool:
    """Whether the grouped_mm path can run these operands: ``config.grouped_mm``, CUDA sm90+, x, the weights and
    ``others`` all bf16, 16-byte aligned weights that are contiguous or ``transposed``, H and I multiples of 8.

    (CUTLASS wants 16-byte aligned rows in both operand layouts; the Triton kernels take any strides.) Reads only
    metadata (alignment from the storage offset: the allocator's blocks start 512-byte aligned)."""
    from .kernels._jit import interpreting

    if not (config.grouped_mm and x.is_cuda and hasattr(torch, "_grouped_mm") and not interpreting()):
        return False
    if not all((w.is_contiguous() or transposed(w)) and w.storage_offset() * w.element_size() % 16 == 0
               for w in (w_gate_up, w_down)):
        return False
    if not all(t.dtype == torch.bfloat16 for t in (x, w_gate_up, w_down, *others)):
        return False
    H, I = w_down.shape[1], w_down.shape[2]
    return _major(x.device) >= 9 and H % 8 == 0 and I % 8 == 0


def uses_grouped_mm(x, ids, w_gate_up, w_down, *others) -> bool:
    """Whether the training forward (save_h) and the backward of these inputs take the grouped_mm path.
    ``others``: more tensors that must be bf16 (the backward's dy)."""
    return ids.numel() > 0 and grouped_mm_applies(x, w_gate_up, w_down, *others)


def grouped_mm_only(activation: str, gate_up_bias, interleaved: bool) -> bool:
    """Experts that only the grouped_mm path computes: a gate_up bias, interleaved gate/up rows, experts without a
    gate, the softcapped SwiGLU (the fused Triton GEMMs have none of these in their epilogues)."""
    return gate_up_bias is not None or interleaved or not gated(activation) or softcaps(activation) is not None


def inference_on_grouped_mm(x, weights, w_down) -> bool:
    """Whether the forward that keeps nothing takes the grouped_mm path (where it applies) rather than the fused
    Triton GEMMs: ``config.inference_grouped_mm``, or by default when the routing weights are wider than x or the
    experts' intermediate size is ``config.inference_min_width`` or more.

    The fused forward keeps each token's k weighted slots in the promoted dtype of the weights and the expert
    outputs, as the reference sums them: routing weights wider than x (Mixtral, DeepSeek-V2, GLM-4.5 keep them in
    fp32) double those [T*k, H] bytes. The grouped_mm path folds the weight in before the down GEMM and writes the
    slots in x's dtype. With bf16 weights the fused GEMMs win on narrow experts and lose on wide ones: the no_grad
    forward of one layer at T=16384 (H100) took 2.774 ms fused against 2.875 on the path at I=768 (30B), 10.127
    against 9.750 at I=1536 (235B) (bench/results/layer_inference_h100.md)."""
    if config.inference_grouped_mm is not None:
        return config.inference_grouped_mm
    return weights.dtype.itemsize > x.dtype.itemsize or w_down.shape[-1] >= config.inference_min_width


def ragged(rows: int) -> bool:
    """Whether the grouped_mm path's four row-ragged GEMMs of ``rows`` routed rows run the Triton ragged GEMM
    (else torch._grouped_mm): below ``config.ragged_min_rows`` its host cost outweighs its gain."""
    return config.ragged_gemm and rows >= config.ragged_min_rows


def supports(x, ids, weights, w_gate_up, w_down, *, extras: bool = False, gated: bool = True) -> bool:
    """True when the kernels compute these inputs (CUDA, or CPU under a usable Triton interpreter).

    extras: with a gate_up bias, interleaved gate/up rows or no gate (an up projection only), which only the
    grouped_mm path computes. gated False: the weights are an up projection [E, I, H] and [E, H, I] (an extra)."""
    from .kernels.forward import supports as fused_supports

    extras = extras or not gated
    return fused_supports(x, ids, weights, w_gate_up, w_down, gated=gated) and (
        not extras or uses_grouped_mm(x, ids, w_gate_up, w_down))


def on_kernels(x, ids, weights, w_gate_up, w_down, activation: str = "silu", gate_up_bias=None,
               interleaved: bool = False) -> bool:
    """Whether the op runs these inputs on the Triton kernels (CUDA), else on the reference."""
    return x.is_cuda and supports(x, ids, weights, w_gate_up, w_down,
                                  extras=grouped_mm_only(activation, gate_up_bias, interleaved),
                                  gated=gated(activation))


def router_on_kernels(x) -> bool:
    """Whether ``torch.ops.moe_fuse.router`` runs its Triton softmax / top-k kernels (CUDA), else the reference."""
    return x.is_cuda


@dataclass(frozen=True)
class ExpertsPlan:
    """What one experts call runs and keeps. ``forward``: "grouped_mm", "triton" or "reference"; h_rows, rows,
    act_rows and routing_size: the sizes of the saved h [h_rows, 2I], xs [rows, H], aw [act_rows, I] and the int32
    routing buffer (0: not kept). The grouped_mm path's GEMM choice, ``ragged``, follows from the row count alone."""

    forward: str
    h_rows: int = 0
    rows: int = 0
    act_rows: int = 0
    routing_size: int = 0


def host_bound_step(tokens, device: torch.device, grad: bool) -> str | None:
    """Why an MoE block of an inference graph is left to Inductor, or None to fuse it: a step of at most
    ``config.small_step_tokens`` tokens on a GPU (a decode step) is bound by the host's time to issue it, and the
    fused ops issue more host work than Inductor's graph (H100, 30B layer, before this gate: T=8 0.567 against
    0.264 ms, T=64 0.741 against 0.534; docs/performance.md). Under CUDA graphs the host is out of the step and
    the fused ops are the faster (T=1-64: 1.19-1.21x, bench/results/layer_decode_h100.md), so there they run.
    Symbolic token counts are fused."""
    if grad or device.type != "cuda" or config.mode in ("reduce-overhead", "max-autotune"):
        return None
    if not isinstance(tokens, int) or tokens > config.small_step_tokens:
        return None
    return (f"an inference step of {tokens} tokens is bound by the host's time to issue it, and the fused ops issue "
            "more than Inductor's graph: left to Inductor (moe_fuse.mode='reduce-overhead' runs them fused, under "
            "CUDA graphs)")


def padded_attention():
    """The function the padded-mask rewrite calls: with ``config.flash_prefix`` (the default) flash attention for
    the rows before each row's first padded key and FlexAttention for the rest, else FlexAttention alone. The
    two kernels won on the 6-layer 30B-shaped step, 1 x 8192 tokens: 91.02 against 99.79 ms with an all-ones
    mask, 96.41 against 98.30 with right padding (H100, bench/results/train_step_masks_h100.md)."""
    from . import attention

    return attention.causal_prefix_padded_attention if config.flash_prefix else attention.causal_padded_attention


def padded_attention_applies(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """The attention-mask rewrites of a causal mask with key padding or of packed sequences: None where
    ``attention``'s FlexAttention functions compile into fused kernels, forward and backward, for these inputs;
    else why not (the masked call then stays)."""
    if q.device.type != "cuda":
        return f"FlexAttention's compiled backward needs a GPU (the query is on {q.device.type})"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"FlexAttention does not take {q.dtype}"
    d = q.shape[-1]
    if not isinstance(d, int) or d < 16 or d & (d - 1):
        return f"head size {d} is not a power of two from 16 up"
    if q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key / value heads"
    return None


def plan(x, ids, weights, w_gate_up, w_down, *, save_h: bool = False, keep_rows: bool = True,
         activation: str = "silu", gate_up_bias=None, interleaved: bool = False) -> ExpertsPlan:
    """The plan of ``torch.ops.moe_fuse.experts`` for these inputs (see the module docstring).

    save_h: the forward keeps h for the backward (the reference keeps h alone; the kernels also their routing;
    the grouped_mm path, with keep_rows, xs, and with ``config.keep_activation`` aw too: the weight gradients'
    operands)."""
    S = ids.shape[0] * ids.shape[1]
    if not on_kernels(x, ids, weights, w_gate_up, w_down, activation, gate_up_bias, interleaved):
        return ExpertsPlan("reference", h_rows=S if save_h else 0)
    grouped = uses_grouped_mm(x, ids, w_gate_up, w_down)
    if save_h:
        from .kernels import routing_buffer_size as buffer_size

        kept = keep_rows and grouped
        return ExpertsPlan("grouped_mm" if grouped else "triton", h_rows=S, rows=S if kept else 0,
                           act_rows=S if kept and config.keep_activation else 0,
                           routing_size=buffer_size(S, w_gate_up.shape[0]))
    return ExpertsPlan(_forward_without_h(x, ids, weights, w_gate_up, w_down, activation, gate_up_bias,
                                          interleaved))


def _forward_without_h(x, ids, weights, w_gate_up, w_down, activation, gate_up_bias, interleaved) -> str:
    # Weights stored transposed take the grouped_mm path: the fused Triton GEMMs would read them through pointer
    # loads (their TMA descriptors need the contiguous layout).
    on_path = (transposed(w_gate_up) or transposed(w_down) or grouped_mm_only(activation, gate_up_bias, interleaved)
               or inference_on_grouped_mm(x, weights, w_down))
    return "grouped_mm" if on_path and uses_grouped_mm(x, ids, w_gate_up, w_down) else "triton"


def split_backward(x, ids, w_gate_up, w_down, dy, h, routing) -> bool:
    """Whether the training backward runs as three ops (``experts_backward_down``, ``_gate_up``,
    ``_weight_gate_up``): the compiled backward then frees h and aw after the first. Read when the backward is
    traced: the grouped_mm path, with h and the routing kept, and ``config.split_backward``."""
    return bool(config.split_backward and h.numel() and routing.numel()
                and uses_grouped_mm(x, ids, w_gate_up, w_down, dy))


_ONLY_GROUPED_MM = ("gate_up_bias, interleaved gate/up rows, experts without a gate and the softcapped SwiGLU run "
                    "on grouped_mm_path only (CUDA sm90+, bf16); elsewhere use reference.")


def experts_forward(x, ids, weights, w_gate_up, w_down, *, save_h: bool = False, keep_rows: bool = False,
                    swiglu_limit: float | None = None, glu_alpha: float | None = None, activation: str = "silu",
                    gate_up_bias=None, interleaved: bool = False, path: str | None = None):
    """The kernels' forward, on the path ``plan`` picks (never the reference), or on ``path`` ("grouped_mm" or
    "triton") when the caller has the plan already (the op): the result of
    ``reference.experts_forward`` (its swiglu_limit, glu_alpha, activation, gate_up_bias, interleaved; the last two
    and the activations without a gate on the grouped_mm path only).

    y; with save_h (y, h, routing); with keep_rows too (y, h, routing, xs, aw): on the grouped_mm path the
    weight gradients' operands its backward reads (xs the expert-sorted rows of x, aw the weighted activation),
    None each on the Triton path (whose GEMMs gather and recompute)."""
    from .kernels import forward, grouped_mm_path

    if path is None:
        on_path = save_h or _forward_without_h(x, ids, weights, w_gate_up, w_down, activation, gate_up_bias,
                                               interleaved) == "grouped_mm"
        path = "grouped_mm" if on_path and uses_grouped_mm(x, ids, w_gate_up, w_down) else "triton"
    if path == "grouped_mm":
        return grouped_mm_path.experts_forward(
            x, ids, weights, w_gate_up, w_down, save_h=save_h, keep_rows=keep_rows, swiglu_limit=swiglu_limit,
            glu_alpha=glu_alpha, activation=activation, gate_up_bias=gate_up_bias, interleaved=interleaved,
            ragged=ragged(ids.numel()),
        )
    if grouped_mm_only(activation, gate_up_bias, interleaved):
        raise ValueError("experts_forward: " + _ONLY_GROUPED_MM + "experts_forward")
    out = forward.experts_forward(x, ids, weights, w_gate_up, w_down, save_h=save_h, swiglu_limit=swiglu_limit,
                                  glu_alpha=glu_alpha, activation=activation)
    return (*out, None, None) if save_h and keep_rows else out


def experts_backward(dy, x, ids, weights, w_gate_up, w_down, h=None, *, routing=None, xs=None, aw=None,
                     swiglu_limit: float | None = None, glu_alpha: float | None = None, activation: str = "silu",
                     gate_up_bias=None, interleaved: bool = False):
    """The kernels' backward: the result of ``reference.experts_backward`` ((dx, d_weights, d_w_gate_up,
    d_w_down), and d_gate_up_bias with a gate_up_bias), on the grouped_mm path where dy, x and the weights take it,
    else on the Triton path. h, routing, xs, aw: what ``experts_forward(save_h=True, keep_rows=True)`` kept, or
    None to recompute."""
    from .kernels import backward, grouped_mm_path

    if uses_grouped_mm(x, ids, w_gate_up, w_down, dy):
        return grouped_mm_path.experts_backward(
            dy, x, ids, weights, w_gate_up, w_down, h, routing=routing, xs=xs, aw=aw, swiglu_limit=swiglu_limit,
            glu_alpha=glu_alpha, activation=activation, gate_up_bias=gate_up_bias, interleaved=interleaved,
            ragged=ragged(ids.numel()),
        )
    if grouped_mm_only(activation, gate_up_bias, interleaved):
        raise ValueError("experts_backward: " + _ONLY_GROUPED_MM + "experts_backward")
    return backward.experts_backward(dy, x, ids, weights, w_gate_up, w_down, h, routing=routing,
                                     swiglu_limit=swiglu_limit, glu_alpha=glu_alpha, activation=activation,
                                     overlap_wgrad=config.overlap_wgrad)
