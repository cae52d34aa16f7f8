"""Inkling 2's softcapped SwiGLU experts: Cg tanh(gate / Cg) * sigmoid(gate) * Cu tanh(up / Cu), in fp32.

The op against a naive float64 definition with autograd, the tanh of the grouped_mm path's passes against
float64 where its two forms meet, both passes in the interpreter against the float64 reference, the pattern
(what it matches and what it leaves alone), whole tiny Inkling 2 models compiled and with the eager experts
implementation, and the argument checks.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from support import families  # noqa: E402
from support.cases import DEVICE, make_case, poisoned_buffers, random_case, rel_err  # noqa: E402
from support.epilogues import KERNEL_CASES, LIMIT, TOL, check, clear_limit, naive_experts  # noqa: E402
from support.steps import assert_same_step, eager_interface_step, experts_entries, run  # noqa: E402

import moe_fuse.ops  # noqa: E402,F401
from moe_fuse import config, dispatch  # noqa: E402
from support.paths import grouped_mm_backward, grouped_mm_forward  # noqa: E402
from moe_fuse import kernels, reference  # noqa: E402
from moe_fuse.integrations.transformers import experts_epilogue, unsupported_reason  # noqa: E402
from moe_fuse.kernels import grouped_mm_path  # noqa: E402
from moe_fuse.kernels.routing import route  # noqa: E402
from moe_fuse.spec import Epilogue  # noqa: E402

# Caps small against h ~ N(0, 1) (the kernel cases), so that both tanh bend: gate / 0.5 crosses the series'
# bound |v| = 1/4 at |gate| = 1/8, so both forms of the kernels' tanh are used too.
CAPS = (0.5, 0.8)
SOFTCAPPED = reference.softcapped(*CAPS)  # the kernels' activation argument
EPILOGUE = Epilogue("softcapped_silu", *CAPS)  # the op's
INKLING2 = Epilogue("softcapped_silu", 4.0, 25.0)  # the config's defaults


def softcapped_glu64(gate, up, caps=CAPS):
    g_cap, u_cap = caps
    return torch.tanh(gate / g_cap) * g_cap * torch.sigmoid(gate) * (torch.tanh(up / u_cap) * u_cap)


def test_the_activation_names_its_caps():
    assert SOFTCAPPED == "softcapped_silu(0.5, 0.8)"
    assert reference.parse_activation(SOFTCAPPED) == ("softcapped_silu", CAPS)
    assert reference.parse_activation(reference.softcapped(1 / 3, 25)) == ("softcapped_silu", (1 / 3, 25.0))
    assert reference.softcaps("silu") is None and reference.gated(SOFTCAPPED)
    assert reference.parse_activation("softcapped_silu( 4,25 )") == ("softcapped_silu", (4.0, 25.0))
    assert EPILOGUE.encode() == "softcapped_silu(gate_cap=0.5, up_cap=0.8)" and EPILOGUE.softcaps == CAPS
    assert EPILOGUE.kernel_activation == SOFTCAPPED and Epilogue.from_kernel_args(activation=SOFTCAPPED) == EPILOGUE


@pytest.mark.parametrize("limit", [None, LIMIT], ids=["plain", "clamped"])
@pytest.mark.parametrize("save_h", [False, True])
def test_op_matches_softcapped_definition_and_its_autograd(save_h, limit):
    x, ids, weights, w_gate_up, w_down = random_case(k=2)
    w_gate_up = w_gate_up * 2  # h of about N(0, 4): well into both tanh's bends
    leaves = [t.requires_grad_() for t in (x, weights, w_gate_up, w_down)]
    capped = Epilogue("softcapped_silu", *CAPS, swiglu_limit=limit).encode()
    got = torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, save_h, capped)[0]
    want = naive_experts(x, ids, weights, w_gate_up, w_down, limit, glu=softcapped_glu64)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    silu = Epilogue(swiglu_limit=limit).encode()
    silu = torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, save_h, silu)[0]
    assert (silu - want).abs().max() > 0.1  # the caps changed the result: the test can fail
    dy = torch.randn_like(want)
    for g_got, g_want in zip(torch.autograd.grad(got, leaves, dy), torch.autograd.grad(want, leaves, dy)):
        torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("bad, message", [
    ("softcapped_silu(gate_cap=0.0, up_cap=25.0)", "the caps must be positive finite numbers, got 0.0, 25.0"),
    ("softcapped_silu(gate_cap=4.0, up_cap=inf)", "the caps must be positive finite numbers, got 4.0, inf"),
    ("softcapped_silu(gate_cap=four, up_cap=25.0)", "gate_cap=four is not a number"),
    ("softcapped_silu(gate_cap=4.0; up_cap=25.0)", "gate_cap=4.0; up_cap=25.0 is not a number"),
    ("softcapped_silu(4.0, 25.0)", r"'4.0' is not one of the fields"),  # the kernels' spelling is not the op's
    ("softcapped_silu", "the caps must be positive finite numbers, got None, None"),
    ("gelu", r"activation must be one of silu, gelu_tanh, relu2 or softcapped_silu \(with gate_cap and up_cap\), "
             "got 'gelu'"),
])
def test_bad_activations_are_named(bad, message):
    x, ids, weights, w_gate_up, w_down = random_case()
    with pytest.raises(ValueError, match=f"moe_fuse.experts: epilogue .*{message}"):
        torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, False, bad)


def test_bad_caps_and_gate_combinations_are_named():
    with pytest.raises(ValueError, match="the caps must be positive finite numbers, got -1, 2"):
        reference.softcapped(-1, 2)
    with pytest.raises(ValueError, match="the caps must be positive finite numbers, got -1.0, 2.0"):
        Epilogue("softcapped_silu", -1, 2)
    with pytest.raises(ValueError, match="glu_alpha is a gate of its own; it does not combine with 'softcapped_silu"):
        Epilogue("softcapped_silu", *CAPS, glu_alpha=1.702)
    x, ids, weights, w_gate_up, w_down = random_case()
    with pytest.raises(ValueError, match="moe_fuse.experts: .*glu_alpha is a gate of its own; it does not combine "
                                         "with 'softcapped_silu"):
        torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, False,
                                   "softcapped_silu(gate_cap=0.5, up_cap=0.8, glu_alpha=1.702)")


def test_the_fused_triton_gemms_refuse_it():
    """Only grouped_mm_path has the softcapped passes: the all-Triton forward and backward say so instead of
    computing silu."""
    args = make_case(8, 2, 3, 16, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="softcapped SwiGLU run on grouped_mm_path only"):
        dispatch.experts_forward(*args, activation=SOFTCAPPED)
    from moe_fuse.kernels.backward import experts_backward
    from moe_fuse.kernels.forward import experts_forward

    with pytest.raises(ValueError, match="the softcapped SwiGLU runs on grouped_mm_path only"):
        experts_forward(*args, activation=SOFTCAPPED)
    with pytest.raises(ValueError, match="the softcapped SwiGLU runs on grouped_mm_path only"):
        experts_backward(torch.randn(8, 16, device=DEVICE), *args, activation=SOFTCAPPED)


def test_tanh_of_the_passes_on_both_sides_of_the_series_bound(monkeypatch):
    """The passes' tanh is a series below |v| = 1/4 and (1 - e) / (1 + e) above: at and around the bound, at
    tiny, large and infinite v, aw and d_h are as close to float64 as eager's float32 autograd is (within a few
    ulps; where both lose digits to 1 - sigmoid(gate) in a tail, no more than twice eager's error)."""
    g_cap, u_cap = CAPS
    v = torch.tensor([0.0, 1e-30, 1e-7, -1e-3, 0.1, 0.2499999, 0.25, -0.25, 0.2500001, 0.3, -0.7, 2.0, -9.0, 30.0,
                      100.0, float("inf")], dtype=torch.float64)
    n = v.numel()
    gate, up = (v * g_cap).float(), (v.flip(0) * u_cap).float()  # each v as gate / Cg and as up / Cu
    h = torch.cat([gate, up]).view(1, 2 * n).repeat(2, 1)  # two rows, of one expert
    ids = torch.zeros(2, 1, dtype=torch.int64)
    weights = torch.ones(2, 1)
    routing = route(ids.to(DEVICE), 1)
    g = torch.full((2, n), 1.0)
    with poisoned_buffers(monkeypatch):
        aw = grouped_mm_path.swiglu(h.to(DEVICE), routing, weights.view(-1).to(DEVICE), activation=SOFTCAPPED)
        dh, aw2, _ = kernels.backward.dswiglu(g.to(DEVICE), h.to(DEVICE), weights.view(-1).to(DEVICE), routing,
                                              torch.float32, activation=SOFTCAPPED)
    assert torch.equal(aw.cpu(), aw2.cpu())  # the two passes round alike
    got = {"aw": aw.cpu()[0], "d_gate": dh.cpu()[0, :n], "d_up": dh.cpu()[0, n:]}
    results = {}
    for dtype in (torch.float64, torch.float32):  # the reference, and eager's float32 (transformers' formula)
        g_, u_ = gate.to(dtype).requires_grad_(), up.to(dtype).requires_grad_()
        out = softcapped_glu64(g_, u_)
        d_gate, d_up = torch.autograd.grad(out.sum(), (g_, u_))
        results[dtype] = {"aw": out.detach(), "d_gate": d_gate, "d_up": d_up}
    for what in got:
        want, eager = results[torch.float64][what], results[torch.float32][what].double()
        finite = want.isfinite()  # inf inputs: eager's autograd gives nan (inf * 0), the passes 0
        assert torch.equal(got[what][~finite], torch.zeros_like(got[what][~finite])), what
        bound = 8 * torch.finfo(torch.float32).eps * want.abs() + 2 * (eager - want).abs()
        err = (got[what].double() - want).abs()
        assert bool((err[finite] <= bound[finite]).all()), (what, err, bound)


NAMES = ("dx", "d_weights", "d_w_gate_up", "d_w_down")


def ref64(args, dtype, dy=None, activation=SOFTCAPPED, limit=None):
    cpu = [t.cpu() for t in args]
    cpu = [t.double() if t.is_floating_point() else t for t in cpu]
    if dy is None:
        return reference.experts_forward(*cpu, activation=activation, swiglu_limit=limit)
    return reference.experts_backward(dy.cpu().double(), *cpu, activation=activation, swiglu_limit=limit)


@pytest.mark.parametrize("clamped", [False, True], ids=["plain", "clamped"])
@pytest.mark.parametrize("name", ["uneven_fp32", "uneven_bf16", "ep_sentinels_fp32"])
def test_grouped_mm_path_matches_reference(name, clamped, monkeypatch):
    """The training path on sm90 (GEMMs, the SwiGLU and dSwiGLU passes); on CPU torch's grouped GEMM
    fallback and the interpreter. h and the rows kept or recomputed: bitwise the same. Clamped: swiglu_limit's
    clamps first, then the softcaps (the passes apply them in that order, as the reference)."""
    monkeypatch.setattr(config, "ragged_min_rows", 0)
    T, k, E, H, I, dtype, mode = KERNEL_CASES[name]
    args = make_case(T, k, E, H, I, dtype, mode, seed=len(name))
    limit = clear_limit(args, dtype) if clamped else None
    gate = {"activation": SOFTCAPPED, "swiglu_limit": limit}
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    with poisoned_buffers(monkeypatch):
        y, h, routing, xs, aw = grouped_mm_forward(*args, save_h=True, keep_rows=True, **gate)
        kept = grouped_mm_backward(dy, *args, h, routing=routing, xs=xs, aw=aw, **gate)
        recomputed = grouped_mm_backward(dy, *args, **gate)
    check([y], [ref64(args, dtype, limit=limit)], TOL[dtype], ["y"])
    want = ref64(args, dtype, dy, limit=limit)
    check(kept, want, TOL[dtype], NAMES)
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)
    # the caps matter in this case (plain), and so do the clamps (clamped)
    other = ref64(args, dtype, dy) if clamped else ref64(args, dtype, dy, activation="silu")
    assert rel_err(kept[2].cpu(), other[2]) > 10 * TOL[dtype]


def test_inkling2_experts_are_fused_with_their_caps(tmp_path):
    model, eager, fused, reports = run("inkling2", tmp_path)
    matches = experts_entries(reports, "matches")
    assert len(matches) == 2 and all((m["activation"], m["gate_cap"], m["up_cap"]) == ("softcapped_silu", 4.0, 25.0)
                                     and m["epilogue"] == INKLING2.encode() for m in matches), matches
    after = "".join(p.read_text() for p in tmp_path.glob("graph_*/after.py"))
    assert "torch.ops.moe_fuse.experts.default(" in after
    assert ", True, 'softcapped_silu(gate_cap=4.0, up_cap=25.0)')" in after
    assert_same_step(eager, fused, output=True)
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert experts and all(experts_epilogue(m) == INKLING2 for m in experts)
    assert all(unsupported_reason(m) is None for m in experts)


def test_the_config_caps_reach_the_op(tmp_path):
    model, eager, fused, reports = run("inkling2", tmp_path, mlp_gate_softcap=0.75, mlp_up_softcap=1.5)
    matches = experts_entries(reports, "matches")
    assert [m["epilogue"] for m in matches] == ["softcapped_silu(gate_cap=0.75, up_cap=1.5)"] * 2, matches
    assert_same_step(eager, fused, output=True)


def test_a_gate_that_only_looks_softcapped_is_left_alone(tmp_path, monkeypatch):
    """tanh(v / C) scaled by 2 C: no match, the reason names it, results unchanged; the probe refuses it too."""
    from transformers.models.inkling2 import modeling_inkling2 as mi

    monkeypatch.setattr(mi.Inkling2Softcap, "forward",
                        lambda self, v: torch.tanh(v / self.softcap) * (2 * self.softcap))
    model, eager, fused, reports = run("inkling2", tmp_path)
    assert not experts_entries(reports, "matches")
    reasons = [e["reason"] for e in experts_entries(reports, "rejected")]
    assert reasons and all("expected by 4.0 (a softcap)" in r for r in reasons), reasons
    assert_same_step(eager, fused, output=True)
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert experts and all(experts_epilogue(m) is None for m in experts)
    assert "a custom gating function (Inkling2Experts._apply_gate)" == unsupported_reason(experts[0])


def test_eager_experts_implementation_passes_the_caps():
    """``set_experts_implementation("moe_fuse")`` on Inkling 2: one fused op call per block with its caps, no
    fallback, eager's loss and gradients."""
    model, inputs = families.build("inkling2")
    eager = families.loss_and_grads(model, inputs)
    fused, gates = eager_interface_step(model, inputs)
    assert gates == [INKLING2] * 2, gates
    assert_same_step(eager, fused)



@pytest.mark.parametrize("name", ["uneven_fp32", "uneven_bf16"])
def test_with_a_gate_up_bias_and_interleaved_rows(name, monkeypatch):
    """The softcaps after the bias, on gate and up read as even and odd columns (the passes share those loads with
    every gate): against the float64 reference, the bias gradient included."""
    from support.cases import BIAS_NAMES, biases

    monkeypatch.setattr(config, "ragged_min_rows", 0)
    T, k, E, H, I, dtype, mode = KERNEL_CASES[name]
    args = make_case(T, k, E, H, I, dtype, mode, seed=len(name))
    gate = {"activation": SOFTCAPPED, "gate_up_bias": biases(E, 2 * I, H, dtype)[0].to(DEVICE), "interleaved": True}
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    with poisoned_buffers(monkeypatch):
        y, h, routing, xs, aw = grouped_mm_forward(*args, save_h=True, keep_rows=True, **gate)
        grads = grouped_mm_backward(dy, *args, h, routing=routing, xs=xs, aw=aw, **gate)
    cpu = [t.cpu().double() if t.is_floating_point() else t.cpu() for t in args]
    ref_gate = {**gate, "gate_up_bias": gate["gate_up_bias"].cpu().double()}
    check([y], [reference.experts_forward(*cpu, **ref_gate)], TOL[dtype], ["y"])
    want = reference.experts_backward(dy.cpu().double(), *cpu, **ref_gate)
    assert len(grads) == 5
    check(grads, want, TOL[dtype], BIAS_NAMES)
    concat = reference.experts_backward(dy.cpu().double(), *cpu, **{**ref_gate, "interleaved": False})
    assert rel_err(grads[2].cpu(), concat[2]) > 10 * TOL[dtype]  # the column order matters in this case
