"""GeGLU experts (Gemma 4, DiffusionGemma): gelu(gate, approximate="tanh") * up in every layer of moe_fuse.

The op against a naive float64 definition with autograd, the Triton kernels of both paths in the
interpreter against the float64 reference, the pattern (what it matches and what it leaves alone),
whole tiny Gemma 4 models compiled and with the eager experts implementation, and the argument checks.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from support import families  # noqa: E402
from support.cases import DEVICE, make_case, poisoned_buffers, random_case, rel_err  # noqa: E402
from support.epilogues import KERNEL_CASES, LIMIT, TOL, check, naive_experts  # noqa: E402
from support.steps import assert_same_step, eager_interface_step, experts_entries, run  # noqa: E402

import moe_fuse.ops  # noqa: E402,F401
from moe_fuse import config, dispatch  # noqa: E402
from support.paths import grouped_mm_backward, grouped_mm_forward  # noqa: E402
from moe_fuse import kernels, reference  # noqa: E402
from moe_fuse.integrations.transformers import activation_of, experts_epilogue, unsupported_reason  # noqa: E402
from moe_fuse.kernels import grouped_mm_path  # noqa: E402
from moe_fuse.spec import Epilogue  # noqa: E402

GELU = Epilogue("gelu_tanh")


def geglu(gate, up):
    return F.gelu(gate, approximate="tanh") * up


@pytest.mark.parametrize("limit", [None, LIMIT], ids=["plain", "clamped"])
@pytest.mark.parametrize("save_h", [False, True])
def test_op_matches_geglu_definition_and_its_autograd(save_h, limit):
    x, ids, weights, w_gate_up, w_down = random_case(k=2)
    w_gate_up = w_gate_up * 2  # gates of about N(0, 4): gelu's curved part and both tails
    leaves = [t.requires_grad_() for t in (x, weights, w_gate_up, w_down)]
    geglu_epilogue = Epilogue("gelu_tanh", swiglu_limit=limit).encode()
    got = torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, save_h, geglu_epilogue)[0]
    want = naive_experts(x, ids, weights, w_gate_up, w_down, limit, glu=geglu)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    silu = Epilogue(swiglu_limit=limit).encode()
    silu = torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, save_h, silu)[0]
    assert (silu - want).abs().max() > 0.1  # the activation changed the result: the test can fail
    dy = torch.randn_like(want)
    for g_got, g_want in zip(torch.autograd.grad(got, leaves, dy), torch.autograd.grad(want, leaves, dy)):
        torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-10)


def test_bad_activation_arguments_are_named():
    x, ids, weights, w_gate_up, w_down = random_case()
    with pytest.raises(ValueError, match=r"activation must be one of silu, gelu_tanh, relu2 or .*, got 'gelu'"):
        torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, False, "gelu")
    with pytest.raises(ValueError, match="glu_alpha is a gate of its own; it does not combine with 'gelu_tanh'"):
        Epilogue("gelu_tanh", glu_alpha=1.702)
    with pytest.raises(ValueError, match="moe_fuse.experts: .*glu_alpha is a gate of its own; it does not combine "
                                         "with 'gelu_tanh'"):
        torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, False, "gelu_tanh(glu_alpha=1.702)")


def ref64(args, dtype, dy=None):
    cpu = [t.cpu() for t in args]
    cpu = [t.double() if t.is_floating_point() else t for t in cpu]
    if dy is None:
        return reference.experts_forward(*cpu, activation="gelu_tanh")
    return reference.experts_backward(dy.cpu().double(), *cpu, activation="gelu_tanh")


NAMES = ("dx", "d_weights", "d_w_gate_up", "d_w_down")


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_triton_kernels_match_reference(name, monkeypatch):
    """The all-Triton path: gate_up's epilogue, the dSwiGLU pass (h kept) and the dgrad epilogue (h recomputed)."""
    T, k, E, H, I, dtype, mode = KERNEL_CASES[name]
    args = make_case(T, k, E, H, I, dtype, mode, seed=len(name))
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    with poisoned_buffers(monkeypatch):
        y = dispatch.experts_forward(*args, activation="gelu_tanh")
        _, h, routing = dispatch.experts_forward(*args, save_h=True, activation="gelu_tanh")
        saved = dispatch.experts_backward(dy, *args, h, routing=routing, activation="gelu_tanh")
        recomputed = dispatch.experts_backward(dy, *args, activation="gelu_tanh")
    check([y], [ref64(args, dtype)], TOL[dtype], ["y"])
    want = ref64(args, dtype, dy)
    check(saved, want, TOL[dtype], NAMES)
    check(recomputed, want, TOL[dtype], NAMES)
    silu = dispatch.experts_backward(dy, *args, h, routing=routing)
    assert rel_err(silu[2].cpu(), want[2]) > 10 * TOL[dtype]  # the activation matters in this case


@pytest.mark.parametrize("name", ["uneven_fp32", "uneven_bf16"])
def test_grouped_mm_path_matches_reference(name, monkeypatch):
    """The training path on sm90 (GEMMs, the SwiGLU and dSwiGLU passes); on CPU torch's grouped GEMM
    fallback and the interpreter."""
    monkeypatch.setattr(config, "ragged_min_rows", 0)
    T, k, E, H, I, dtype, mode = KERNEL_CASES[name]
    args = make_case(T, k, E, H, I, dtype, mode, seed=len(name))
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    with poisoned_buffers(monkeypatch):
        y, h, routing, xs, aw = grouped_mm_forward(
            *args, save_h=True, keep_rows=True, activation="gelu_tanh")
        kept = grouped_mm_backward(dy, *args, h, routing=routing, xs=xs, aw=aw, activation="gelu_tanh")
        recomputed = grouped_mm_backward(dy, *args, activation="gelu_tanh")
    check([y], [ref64(args, dtype)], TOL[dtype], ["y"])
    check(kept, ref64(args, dtype, dy), TOL[dtype], NAMES)
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)


def test_gemma4_experts_are_fused_with_the_gelu_gate(tmp_path):
    model, eager, fused, reports = run("gemma4", tmp_path)
    matches = experts_entries(reports, "matches")
    assert len(matches) == 2 and all(m["activation"] == "gelu_tanh" for m in matches), matches
    after = "".join(p.read_text() for p in tmp_path.glob("graph_*/after.py"))
    assert "torch.ops.moe_fuse.experts.default(" in after and ", True, 'gelu_tanh')" in after
    assert_same_step(eager, fused, output=True)
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert experts and all(experts_epilogue(m) == GELU and unsupported_reason(m) is None for m in experts)


def test_exact_gelu_is_left_alone_with_its_reason(tmp_path):
    """gelu without the tanh approximation (erf): no match, the reason says why, results unchanged."""
    model, eager, fused, reports = run("gemma4", tmp_path, hidden_activation="gelu")
    assert not experts_entries(reports, "matches")
    reasons = [e["reason"] for e in experts_entries(reports, "rejected")]
    assert reasons and all("gelu with approximate='none': only the tanh form is fused" in r for r in reasons), reasons
    assert_same_step(eager, fused, output=True)
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert experts and all(activation_of(m.act_fn) is None for m in experts)
    assert "not silu or tanh-approximated gelu" in unsupported_reason(experts[0])


def test_eager_experts_implementation_passes_the_activation():
    """``set_experts_implementation("moe_fuse")`` on Gemma 4: one fused op call per block with the gelu gate,
    no fallback, eager's loss and gradients."""
    model, inputs = families.build("gemma4")
    eager = families.loss_and_grads(model, inputs)
    fused, gates = eager_interface_step(model, inputs)
    assert gates == [GELU, GELU], gates
    assert_same_step(eager, fused)
