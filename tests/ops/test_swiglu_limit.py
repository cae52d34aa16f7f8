"""transformers' clamped SwiGLU (``swiglu_limit``: GLM-5-Next, HY-V4, HY-V4-VL, DeepSeek-V4):
silu(gate.clamp(max=L)) * up.clamp(-L, L), and the GPT-OSS-style gate on those clamps (``swiglu_alpha``:
MiniMax-M3-VL), gate * sigmoid(a * gate) * (up + 1), in every layer of moe_fuse.

The op against a naive float64 definition with autograd (clamp's own backward: a clamped value passes
no gradient, the bound itself does), the Triton kernels of both paths in the interpreter against the
float64 reference, the pattern (what it matches, what it refuses and why), and whole tiny models with
a limit small enough that most values are clamped.
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
from support.epilogues import KERNEL_CASES, LIMIT, TOL, check, clear_limit, exact_h, naive_experts  # noqa: E402
from support.steps import assert_same_step, compare, eager_interface_step, experts_entries, run  # noqa: E402

import moe_fuse.ops  # noqa: E402,F401
from moe_fuse import config, dispatch  # noqa: E402
from support.paths import grouped_mm_backward, grouped_mm_forward  # noqa: E402
from moe_fuse import kernels, reference  # noqa: E402
from moe_fuse.integrations.transformers import gate_epilogue, unsupported_reason  # noqa: E402
from moe_fuse.kernels import grouped_mm_path  # noqa: E402
from moe_fuse.spec import Epilogue  # noqa: E402

ALPHA = 1.702  # GPT-OSS's and MiniMax-M3-VL's


def clamped_fraction(x, ids, w_gate_up, limit):
    return (exact_h(x, ids, w_gate_up).abs() > limit).double().mean().item()


@pytest.mark.parametrize("alpha", [None, ALPHA], ids=["silu", "alpha_gate"])
@pytest.mark.parametrize("save_h", [False, True])
def test_op_matches_clamped_definition_and_its_autograd(save_h, alpha):
    x, ids, weights, w_gate_up, w_down = random_case(k=2)
    w_gate_up = w_gate_up * 2  # h of about N(0, 4): many values on both sides of the limit
    assert 0.3 < clamped_fraction(x, ids, w_gate_up, LIMIT) < 0.9
    leaves = [t.requires_grad_() for t in (x, weights, w_gate_up, w_down)]
    epilogue = Epilogue(swiglu_limit=LIMIT, glu_alpha=alpha).encode()
    got = torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, save_h, epilogue)[0]
    want = naive_experts(x, ids, weights, w_gate_up, w_down, LIMIT, alpha)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    unclamped = torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, save_h)[0]
    assert (unclamped - want).abs().max() > 0.1  # the limit changed the result: the test can fail
    dy = torch.randn_like(want)
    for g_got, g_want in zip(torch.autograd.grad(got, leaves, dy), torch.autograd.grad(want, leaves, dy)):
        torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-10)


def test_bound_itself_passes_gradient_as_in_eager():
    h = torch.tensor([[LIMIT, 2.0, -LIMIT, 0.1, LIMIT, -2.0]], dtype=torch.float64, requires_grad=True)
    gate, up = h.chunk(2, dim=-1)
    eager = torch.autograd.grad((F.silu(gate.clamp(max=LIMIT)) * up.clamp(-LIMIT, LIMIT)).sum(), h)[0]
    ref_gate, ref_up = reference.clamp_gate_up(*h.detach().chunk(2, dim=-1), LIMIT)
    assert torch.equal(ref_gate, gate.detach().clamp(max=LIMIT)) and torch.equal(ref_up, up.detach().clamp(-LIMIT, LIMIT))
    # gate = L passes (inclusive), gate 2 does not; up = -L and L pass, up = -2 does not
    assert (eager[0, :3] != 0).tolist() == [True, False, True] and (eager[0, 3:] != 0).tolist() == [True, True, False]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_limit_is_named(bad):
    """By the Epilogue, and by the op given the string such an Epilogue would encode to."""
    x, ids, weights, w_gate_up, w_down = random_case()
    with pytest.raises(ValueError, match="swiglu_limit must be a positive finite number"):
        Epilogue(swiglu_limit=bad)
    with pytest.raises(ValueError, match="moe_fuse.experts: .*swiglu_limit must be a positive finite number"):
        torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, False, f"silu(swiglu_limit={bad!r})")
    if bad != 0.0 and bad != -1.0:
        with pytest.raises(ValueError, match="glu_alpha must be a finite number"):
            Epilogue(glu_alpha=bad)
        with pytest.raises(ValueError, match="moe_fuse.experts: .*glu_alpha must be a finite number"):
            torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, False, f"silu(glu_alpha={bad!r})")


def ref64(args, limit, dtype, dy=None, alpha=None):
    cpu = [t.cpu() for t in args]
    cpu = [t.double() if t.is_floating_point() else t for t in cpu]
    lim = reference.limit_in(dtype, limit)  # the bound as h's dtype holds it, as the kernels clamp
    if dy is None:
        return reference.experts_forward(*cpu, swiglu_limit=lim, glu_alpha=alpha)
    return reference.experts_backward(dy.cpu().double(), *cpu, swiglu_limit=lim, glu_alpha=alpha)


@pytest.mark.parametrize("alpha", [None, ALPHA], ids=["silu", "alpha_gate"])
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_triton_kernels_match_reference(name, alpha, monkeypatch):
    """The all-Triton path: gate_up's SwiGLU epilogue, the dSwiGLU pass (h kept) and the dgrad epilogue
    (h recomputed, as in checkpointed layers)."""
    T, k, E, H, I, dtype, mode = KERNEL_CASES[name]
    args = make_case(T, k, E, H, I, dtype, mode, seed=len(name))
    limit = clear_limit(args, dtype)
    assert clamped_fraction(args[0], args[1].clamp(max=E - 1), args[3], limit) > 0.3
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    gate = {"swiglu_limit": limit, "glu_alpha": alpha}
    with poisoned_buffers(monkeypatch):
        y = dispatch.experts_forward(*args, **gate)
        _, h, routing = dispatch.experts_forward(*args, save_h=True, **gate)
        saved = dispatch.experts_backward(dy, *args, h, routing=routing, **gate)
        recomputed = dispatch.experts_backward(dy, *args, **gate)
    check([y], [ref64(args, limit, args[3].dtype, alpha=alpha)], TOL[dtype], ["y"])
    want = ref64(args, limit, args[3].dtype, dy, alpha=alpha)
    names = ("dx", "d_weights", "d_w_gate_up", "d_w_down")
    check(saved, want, TOL[dtype], names)
    check(recomputed, want, TOL[dtype], names)
    unclamped = dispatch.experts_backward(dy, *args, h, routing=routing)
    assert rel_err(unclamped[2].cpu(), want[2]) > 10 * TOL[dtype]  # the limit matters in this case


@pytest.mark.parametrize("alpha", [None, ALPHA], ids=["silu", "alpha_gate"])
@pytest.mark.parametrize("name", ["uneven_fp32", "uneven_bf16"])
def test_grouped_mm_path_matches_reference(name, alpha, monkeypatch):
    """The training path on sm90 (torch._grouped_mm, the SwiGLU and dSwiGLU passes); on CPU torch's
    grouped GEMM fallback and the interpreter."""
    monkeypatch.setattr(config, "ragged_min_rows", 0)
    T, k, E, H, I, dtype, mode = KERNEL_CASES[name]
    args = make_case(T, k, E, H, I, dtype, mode, seed=len(name))
    limit = clear_limit(args, dtype)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    gate = {"swiglu_limit": limit, "glu_alpha": alpha}
    with poisoned_buffers(monkeypatch):
        y, h, routing, xs, aw = grouped_mm_forward(*args, save_h=True, keep_rows=True, **gate)
        kept = grouped_mm_backward(dy, *args, h, routing=routing, xs=xs, aw=aw, **gate)
        recomputed = grouped_mm_backward(dy, *args, **gate)
    check([y], [ref64(args, limit, args[3].dtype, alpha=alpha)], TOL[dtype], ["y"])
    want = ref64(args, limit, args[3].dtype, dy, alpha=alpha)
    names = ("dx", "d_weights", "d_w_gate_up", "d_w_down")
    check(kept, want, TOL[dtype], names)
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- pattern and whole models


# glm5_next: a graph break inside the layer makes both layers run one compiled graph (one match)
@pytest.mark.parametrize("name,blocks", [("hy_v4", 2), ("glm5_next", 1)])
def test_clamped_family_is_fused_with_its_limit(name, blocks, tmp_path):
    # A limit well inside the values the tiny models produce, so the clamps decide the result.
    model, eager, fused, reports = run(name, tmp_path, swiglu_limit=0.05)
    matches = experts_entries(reports, "matches")
    assert len(matches) == blocks and all(m["swiglu_limit"] == 0.05 for m in matches), matches
    after = "".join(p.read_text() for p in tmp_path.glob("graph_*/after.py"))
    assert "torch.ops.moe_fuse.experts.default(" in after and ", True, 'silu(swiglu_limit=0.05)')" in after
    assert_same_step(eager, fused, output=True)
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert experts and all(gate_epilogue(m) == Epilogue(swiglu_limit=0.05) and unsupported_reason(m) is None
                           for m in experts)


def test_a_gate_that_only_looks_clamped_is_left_alone(tmp_path, monkeypatch):
    """Only the gate clamped (up not): no match, the reason names the op that breaks it, results unchanged."""
    from transformers.models.hy_v4 import modeling_hy_v4

    def gate_only(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=self.swiglu_limit)) * up

    monkeypatch.setattr(modeling_hy_v4.HYV4Experts, "_apply_gate", gate_only)
    model, eager, fused, reports = run("hy_v4", tmp_path, swiglu_limit=0.05)
    assert not experts_entries(reports, "matches")
    reasons = [r["reason"] for r in experts_entries(reports, "rejected")]
    assert reasons and all("is read by mul; expected one clamp" in r for r in reasons), reasons
    assert families.rel_err(fused[0], eager[0]) < families.TOLERANCE
    experts = [m for m in model.modules() if type(m).__name__ == "HYV4Experts"]
    assert all(gate_epilogue(m) is None and "custom gating function" in unsupported_reason(m) for m in experts)


def test_minimax_alpha_gate_is_fused_with_its_constants(tmp_path):
    model, eager, fused, reports = run("minimax_m3_vl", tmp_path, swiglu_limit=0.05)
    matches = experts_entries(reports, "matches")
    assert len(matches) == 2 and all((m["swiglu_limit"], m["glu_alpha"]) == (0.05, ALPHA) for m in matches), matches
    assert_same_step(eager, fused)
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert experts and all(gate_epilogue(m) == Epilogue(swiglu_limit=0.05, glu_alpha=ALPHA)
                           and unsupported_reason(m) is None for m in experts)


def test_an_alpha_gate_with_another_shift_is_left_alone(tmp_path, monkeypatch):
    """(up + 2) instead of (up + 1): no match, the reason says so, results unchanged; the probe refuses it too."""
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mm

    def shifted(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return (up + 2.0) * (gate * torch.sigmoid(gate * self.swiglu_alpha))

    monkeypatch.setattr(mm.MiniMaxM3VLExperts, "_apply_gate", shifted)
    model, eager, fused, reports = run("minimax_m3_vl", tmp_path, swiglu_limit=0.05)
    assert not experts_entries(reports, "matches")
    reasons = [r["reason"] for r in experts_entries(reports, "rejected")]
    assert reasons and all("expected up + 1" in r for r in reasons), reasons
    assert families.rel_err(fused[0], eager[0]) < families.TOLERANCE
    experts = [m for m in model.modules() if type(m).__name__ == "MiniMaxM3VLExperts"]
    assert experts and all(gate_epilogue(m) is None for m in experts)


def test_checkpointed_layers_keep_the_limit_and_recompute_h(tmp_path):
    """Inside activation checkpointing the rewrite turns save_h off; the limit stays in the op's epilogue."""
    import re

    # output_router_logits: its recording hook inside a checkpoint makes Dynamo run the layer eagerly
    model, inputs = families.build("hy_v4", swiglu_limit=0.05, output_router_logits=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    eager, fused, _ = compare(model, inputs, tmp_path)
    after = "".join(p.read_text() for p in sorted(tmp_path.glob("graph_*/after.py")))
    calls = re.findall(r"torch\.ops\.moe_fuse\.experts\.default\([^;]*, (True|False), "
                       r"'silu\(swiglu_limit=([0-9.]+)\)'\)", after)
    assert calls == [("False", "0.05")] * 2, calls
    assert_same_step(eager, fused)


def test_eager_experts_implementation_passes_the_limit():
    """``set_experts_implementation("moe_fuse")`` (no torch.compile) on a clamped family: one fused op call per
    block, with the limit, and eager's loss and gradients."""
    model, inputs = families.build("hy_v4", swiglu_limit=0.05)
    eager = families.loss_and_grads(model, inputs)
    fused, gates = eager_interface_step(model, inputs)
    limits = [g.swiglu_limit for g in gates]
    assert limits == [0.05, 0.05], limits
    assert_same_step(eager, fused)
