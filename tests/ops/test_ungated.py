"""Experts without a gate (transformers' ``has_gate=False``: Nemotron-H): an up projection [E, I, H] and a
squared ReLU, the epilogue "relu2" on the experts op.

The op against a naive float64 definition with autograd, the grouped_mm path's passes in the interpreter
against the float64 reference, the dispatch (that path or the reference, never the fused Triton GEMMs), the
pattern on whole tiny Nemotron-H models (and what it leaves alone), the eager experts implementation, and the
argument checks.
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
from support.epilogues import KERNEL_CASES, TOL, check  # noqa: E402
from support.steps import assert_same_step, eager_interface_step, experts_entries, run  # noqa: E402

import moe_fuse.ops  # noqa: E402,F401
from moe_fuse import config, dispatch  # noqa: E402
from support.paths import grouped_mm_backward, grouped_mm_forward  # noqa: E402
from moe_fuse import kernels, reference  # noqa: E402
from moe_fuse.integrations.transformers import experts_epilogue, unsupported_reason  # noqa: E402
from moe_fuse.kernels import _jit, grouped_mm_path  # noqa: E402
from moe_fuse.spec import Epilogue  # noqa: E402

RELU2 = Epilogue("relu2")
assert RELU2.encode() == "relu2"  # the op's epilogue argument
NAMES = ("dx", "d_weights", "d_w_up", "d_w_down")


def ungated(case):
    """make_case / random_case's gated weights -> (x, ids, weights, W_up [E, I, H], W_down): the gate rows dropped."""
    x, ids, weights, w_gate_up, w_down = case
    return [x, ids, weights, w_gate_up[:, : w_down.shape[2]].contiguous(), w_down]


def naive_experts(x, ids, weights, w_up, w_down):
    E = w_up.shape[0]
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < E:  # an id >= E is an expert-parallel sentinel: another rank's expert
                acc = acc + weights[t, j] * (w_down[e] @ F.relu(w_up[e] @ x[t]) ** 2)
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("sentinel_fraction", [0.0, 0.3])
@pytest.mark.parametrize("save_h", [False, True])
def test_op_matches_squared_relu_definition_and_its_autograd(save_h, sentinel_fraction):
    x, ids, weights, w_up, w_down = ungated(random_case(k=3, sentinel_fraction=sentinel_fraction))
    leaves = [t.requires_grad_() for t in (x, weights, w_up, w_down)]
    got, h = torch.ops.moe_fuse.experts(x, ids, weights, w_up, w_down, save_h, "relu2")[:2]
    want = naive_experts(x, ids, weights, w_up, w_down)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert h.shape == ((x.shape[0] * 3, w_up.shape[1]) if save_h else (0, w_up.shape[1]))
    dy = torch.randn_like(want)
    for g_got, g_want in zip(torch.autograd.grad(got, leaves, dy), torch.autograd.grad(want, leaves, dy)):
        torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-10)


def test_opcheck():
    x, ids, weights, w_up, w_down = ungated(random_case(k=2, dtype=torch.float32))
    for t in (x, weights, w_up, w_down):
        t.requires_grad_()
    torch.library.opcheck(torch.ops.moe_fuse.experts.default, (x, ids, weights, w_up, w_down, True, "relu2"))


def test_bad_arguments_are_named():
    x, ids, weights, w_gate_up, w_down = random_case()
    with pytest.raises(ValueError, match=r"experts without a gate \('relu2'\) must be up \[E, I, H\] and down "
                                         r"\[E, H, I\]; got \(5, 20, 12\) and \(5, 12, 10\)"):
        torch.ops.moe_fuse.experts(x, ids, weights, w_gate_up, w_down, False, "relu2")
    w_up = w_gate_up[:, :10]
    no_gate = "activation 'relu2' has no gate; swiglu_limit, glu_alpha, gate_up_bias and interleaved are gate options"
    for options in ({"swiglu_limit": 1.0}, {"glu_alpha": 1.0}, {"interleaved": True}):
        with pytest.raises(ValueError, match=no_gate if "glu_alpha" not in options else "glu_alpha is a gate of its"):
            Epilogue("relu2", **options)
    with pytest.raises(ValueError, match="moe_fuse.experts: epilogue 'relu2\\(swiglu_limit=1.0\\)': " + no_gate):
        torch.ops.moe_fuse.experts(x, ids, weights, w_up, w_down, False, "relu2(swiglu_limit=1.0)")
    with pytest.raises(ValueError, match="moe_fuse.experts: " + no_gate):
        torch.ops.moe_fuse.experts(x, ids, weights, w_up, w_down, False, "relu2", torch.zeros(5, 10))
    with pytest.raises(ValueError, match=r"activation must be one of silu, gelu_tanh, relu2 or .*, got 'relu'"):
        torch.ops.moe_fuse.experts(x, ids, weights, w_up, w_down, False, "relu")


def ref64(args, dy=None):
    cpu = [t.cpu() for t in args]
    cpu = [t.double() if t.is_floating_point() else t for t in cpu]
    if dy is None:
        return reference.experts_forward(*cpu, activation="relu2")
    return reference.experts_backward(dy.cpu().double(), *cpu, activation="relu2")


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged_gemm", "grouped_mm"])
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_grouped_mm_path_matches_reference(name, ragged, monkeypatch):
    """The training path on sm90 (GEMMs and the two passes of kernels/ungated.py); on CPU torch's grouped GEMM
    fallback and the interpreter. What the forward keeps equals what the backward recomputes."""
    monkeypatch.setattr(config, "ragged_gemm", ragged)
    monkeypatch.setattr(config, "ragged_min_rows", 0)
    T, k, E, H, I, dtype, mode = KERNEL_CASES[name]
    args = ungated(make_case(T, k, E, H, I, dtype, mode, seed=len(name)))
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    with poisoned_buffers(monkeypatch):
        y, h, routing, xs, aw = grouped_mm_forward(*args, save_h=True, keep_rows=True, activation="relu2")
        y_only = grouped_mm_forward(*args, activation="relu2")
        kept = grouped_mm_backward(dy, *args, h, routing=routing, xs=xs, aw=aw, activation="relu2")
        recomputed = grouped_mm_backward(dy, *args, activation="relu2")
    assert h.shape == (T * k, I) and aw.shape == (T * k, I)
    assert torch.equal(y, y_only)
    check([y], [ref64(args)], TOL[dtype], ["y"])
    want = ref64(args, dy)
    check(kept, want, TOL[dtype], NAMES)
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)
    routed = int(routing.offsets[-1])
    w = args[2].reshape(-1)[routing.order.long()][:routed, None].float()
    torch.testing.assert_close(aw[:routed].float(), w * F.relu(h[:routed].float()) ** 2,
                               **({} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}))
    silu = reference.experts_backward(dy.cpu().double(), *[t.cpu().double() if t.is_floating_point() else t.cpu()
                                                           for t in make_case(T, k, E, H, I, dtype, mode,
                                                                              seed=len(name))])
    assert rel_err(kept[0].cpu(), silu[0]) > 10 * TOL[dtype]  # a different function: this test can fail


def test_dispatch_takes_the_grouped_mm_path_or_the_reference(monkeypatch):
    """Only grouped_mm_path computes experts without a gate: where it does not apply (the CPU, here) the kernels
    refuse them and the op runs the reference (the tests above); where it applies the kernels take it, with or
    without h. bf16 on a GPU (torch's grouped GEMM there takes bf16 only)."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    args = ungated(make_case(12, 2, 4, 16, 8, dtype, seed=5))
    dy = torch.randn(12, 16, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    if not dispatch.grouped_mm_applies(args[0], args[3], args[4]):  # always so on the CPU
        with pytest.raises(ValueError, match="experts without a gate and .* run on grouped_mm_path only"):
            dispatch.experts_forward(*args, activation="relu2")
        with pytest.raises(ValueError, match="experts without a gate and .* run on grouped_mm_path only"):
            dispatch.experts_backward(dy, *args, activation="relu2")
        assert not dispatch.supports(*args, gated=False)  # what the op asks: the reference computes them
    calls = []
    for name in ("experts_forward", "experts_backward"):
        real = getattr(grouped_mm_path, name)
        monkeypatch.setattr(grouped_mm_path, name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    monkeypatch.setattr(dispatch, "grouped_mm_applies", lambda *a: True)
    assert dispatch.supports(*args, gated=False)  # [E, I, H] up weights are no layout error
    y = dispatch.experts_forward(*args, activation="relu2")  # inference too: the fused Triton forward has no relu2
    _, h, routing, xs, aw = dispatch.experts_forward(*args, save_h=True, keep_rows=True, activation="relu2")
    grads = dispatch.experts_backward(dy, *args, h, routing=routing, xs=xs, aw=aw, activation="relu2")
    assert calls == ["experts_forward", "experts_forward", "experts_backward"]
    assert rel_err(y.cpu(), ref64(args)) < TOL[dtype]
    for g, w in zip(grads, ref64(args, dy)):
        assert rel_err(g.cpu(), w) < TOL[dtype]


def test_nemotron_h_experts_are_fused(tmp_path):
    model, eager, fused, reports = run("nemotron_h", tmp_path)
    matches = experts_entries(reports, "matches")
    assert len(matches) == 2 and all(m["activation"] == "relu2" and m["layout"] == "up_only" for m in matches), matches
    after = "".join(p.read_text() for p in tmp_path.glob("graph_*/after.py"))
    assert "torch.ops.moe_fuse.experts.default(" in after and ", True, 'relu2')" in after
    assert_same_step(eager, fused, output=True)


def test_plain_relu_experts_are_left_alone_with_the_reason(tmp_path):
    """relu without the square: no match, the reason says where the pattern left off, results unchanged."""
    model, eager, fused, reports = run("nemotron_h", tmp_path, mlp_hidden_act="relu")
    assert not experts_entries(reports, "matches")
    reasons = [e["reason"] for e in experts_entries(reports, "rejected")]
    assert reasons and all("expected one square or pow or mul" in r for r in reasons), reasons
    assert_same_step(eager, fused, output=True)
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert experts and unsupported_reason(experts[0]) == "no gate and activation ReLU, not a squared ReLU"


def test_eager_experts_implementation_runs_the_op():
    """``set_experts_implementation("moe_fuse")`` on Nemotron-H: one op call per block with relu2, no fallback,
    eager's loss and gradients."""
    model, inputs = families.build("nemotron_h")
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert experts and all(unsupported_reason(m) is None and experts_epilogue(m) == RELU2 for m in experts)
    eager = families.loss_and_grads(model, inputs)
    fused, gates = eager_interface_step(model, inputs)
    assert gates == [RELU2, RELU2], gates
    assert_same_step(eager, fused)


def test_shard_experts_refuses_experts_without_a_gate():
    """The expert-parallel path computes gated experts only: a clear error before anything is touched (no process
    group needed to say so)."""
    from moe_fuse.parallel import shard_experts

    model, _ = families.build("nemotron_h")
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"NemotronHExperts has no gate \(an up projection only\), which the "
                                         r"expert-parallel experts do not compute yet; nothing was sharded"):
        shard_experts(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_left_alone_on_a_gpu_where_the_op_would_run_its_reference(monkeypatch):
    """On CUDA only the grouped_mm path computes experts without a gate (sm90+, bf16); elsewhere the op would run
    its reference loop over the experts, slower than the graph: the pattern does not match there and says why.
    Fake CUDA tensors stand in for the graph's metadata; bf16 on sm90 matches."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moe_fuse.pipeline.graph import NoMatch
    from moe_fuse.patterns.experts_grouped_mm import _check_kernel_path

    def nodes(dtype):  # x, W_up, W_down
        graph = fx.Graph()
        with FakeTensorMode(allow_non_fake_inputs=True):
            values = [torch.empty(6, 16, dtype=dtype, device="cuda"), torch.empty(4, 8, 16, dtype=dtype, device="cuda"),
                      torch.empty(4, 16, 8, dtype=dtype, device="cuda")]
        out = []
        for i, v in enumerate(values):
            node = graph.placeholder(f"p{i}")
            node.meta["example_value"] = v
            out.append(node)
        return out

    monkeypatch.setattr(_jit, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "_CAPABILITY", {0: 9})
    _check_kernel_path(*nodes(torch.bfloat16), False, RELU2, None)  # sm90, bf16: the kernels take it
    with pytest.raises(NoMatch, match=r"experts without a gate run fused on CUDA sm90\+ in bf16 only \(the "
                                      r"grouped_mm path\); here the op would run its reference loop"):
        _check_kernel_path(*nodes(torch.float32), False, RELU2, None)
    monkeypatch.setattr(dispatch, "_CAPABILITY", {0: 8})  # an A100
    with pytest.raises(NoMatch, match="experts without a gate run fused on CUDA sm90"):
        _check_kernel_path(*nodes(torch.bfloat16), False, RELU2, None)


def test_checkpointed_layers_recompute_h(tmp_path):
    """Inside activation checkpointing the rewrite turns save_h off (the backward recomputes h with one GEMM);
    "relu2" stays the op's epilogue, and the step is eager's."""
    import re

    from support.steps import compare

    # output_router_logits: its recording hook inside a checkpoint makes Dynamo run the layer eagerly
    model, inputs = families.build("nemotron_h", output_router_logits=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    eager, fused, _ = compare(model, inputs, tmp_path)
    after = "".join(p.read_text() for p in sorted(tmp_path.glob("graph_*/after.py")))
    calls = re.findall(r"torch\.ops\.moe_fuse\.experts\.default\([^;]*, (True|False), 'relu2'\)", after)
    assert calls == ["False"] * 2, calls
    assert_same_step(eager, fused)
