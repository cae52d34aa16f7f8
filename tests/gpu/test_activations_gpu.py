"""The experts' other gates and layouts on the GPU (Qwen3-30B-A3B's layer size, T=4096), against float64: GeGLU
(Gemma), the clamped SwiGLU and its GPT-OSS gate, the softcapped SwiGLU (Inkling 2), experts without a gate
(Nemotron-H), biases with interleaved gate / up rows (GPT-OSS), weights stored transposed (Aria)."""

import pytest
import torch

from gpu_cases import E, I, check, forward_backward, make_case, needs_sm90, poisoned, ref64

from moe_fuse import config, reference

pytestmark = pytest.mark.gpu

# The clamp's kink: a value within bf16 rounding of the limit is clamped in one computation and not in the other, which
# moves dx and dW_gate_up about 6e-2 from float64 (both paths, H200); the other outputs stay at bf16 rounding.
CLAMPED = ("dx", "dW_gate_up")
GATES = {  # name: (experts' keyword arguments, whether the fused Triton path computes them too)
    "gelu_tanh": (dict(activation="gelu_tanh"), True),
    "swiglu_limit": (dict(swiglu_limit=1.0), True),  # clamps about a third of the gate and up values
    "swiglu_limit_alpha": (dict(swiglu_limit=1.0, glu_alpha=1.702), True),
    "softcapped_inkling2": (dict(activation=reference.softcapped(4.0, 25.0)), False),
    "softcapped_bent": (dict(activation=reference.softcapped(1.0, 2.0)), False),  # caps that bend every value
    "relu2": (dict(activation="relu2"), False),
    "bias_interleaved": (dict(interleaved=True), False),
}


def _case(name):
    gate, _ = GATES[name]
    case = make_case(4096, ungated=name == "relu2", seed=len(name))
    if name == "bias_interleaved":
        gate = dict(gate, gate_up_bias=torch.randn(E, 2 * I, device="cuda").mul(0.1).bfloat16())
    return case, gate


@pytest.mark.parametrize("name, path", [(name, path) for name, (_, on_triton) in GATES.items()
                                        for path in (("grouped_mm", "triton") if on_triton else ("grouped_mm",))])
def test_gate(name, path, monkeypatch):
    if path == "grouped_mm":
        needs_sm90()
    case, gate = _case(name)
    want = ref64(*case, **gate)
    with config.patch(grouped_mm=path == "grouped_mm"):
        with poisoned(monkeypatch):
            got = forward_backward(*case, **gate)
        check(got, want, forward_backward(*case, **gate), loose=CLAMPED if "swiglu_limit" in gate else ())


@pytest.mark.parametrize("name", [name for name, (_, on_triton) in GATES.items() if not on_triton])
def test_gate_off_the_grouped_mm_path_is_an_error(name):
    """What only the grouped_mm path computes, asked of the fused Triton path: an error that says so."""
    case, gate = _case(name)
    with config.patch(grouped_mm=False), pytest.raises(ValueError, match="run on grouped_mm_path only"):
        forward_backward(*case, **gate)


def test_weights_stored_transposed():
    """Weights given as transposed views of [E, in, out] tensors: the same bits as contiguous weights."""
    needs_sm90()
    x, ids, w, wgu, wd, dy = make_case(16384)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (wgu, wd)]
    got = forward_backward(x, ids, w, *views, dy)
    assert all(torch.equal(a, b) for a, b in zip(got, forward_backward(x, ids, w, wgu, wd, dy)))
