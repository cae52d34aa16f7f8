"""The experts op's training backward on grouped_mm_path as three ops, ``experts_backward_down`` (dy to d_h, dW_down),
``experts_backward_gate_up`` (d_h to dx) and ``experts_backward_weight_gate_up`` (d_h and xs to dW_gate_up): the
compiled backward drops the forward's h and aw, which only the first reads, before the second allocates, and orders
the third by memory. The gradients are the single op's bits."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch.library import opcheck  # noqa: E402

from moe_fuse import config, dispatch  # noqa: E402
from moe_fuse import kernels, ops  # noqa: E402
from moe_fuse.kernels import grouped_mm_path  # noqa: E402
from moe_fuse.spec import Epilogue  # noqa: E402
from support.cases import DEVICE, make_case  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _step(args, dy, keep_rows, monkeypatch, split, **gate):
    """Gradients of the op's y (x, weights, both expert weights, the gate_up bias if any) and the grouped_mm_path
    functions its backward ran."""
    calls = []
    with monkeypatch.context() as m:
        for name in ("experts_backward", "backward_down", "backward_gate_up", "backward_weight_gate_up"):
            real = getattr(grouped_mm_path, name)
            m.setattr(grouped_mm_path, name,
                      lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
        m.setattr(config, "split_backward", split)
        x, ids, weights, w_gate_up, w_down = args
        bias = [gate.pop("gate_up_bias")] if "gate_up_bias" in gate else []
        leaves = [t.detach().clone().requires_grad_() for t in (x, weights, w_gate_up, w_down, *bias)]
        if bias:
            gate["gate_up_bias"] = leaves[4]
        y = torch.ops.moe_fuse.experts(leaves[0], ids, *leaves[1:4], True, keep_rows=keep_rows, **gate)[0]
        y.backward(dy)
    return [t.grad for t in leaves], calls


@pytest.mark.parametrize("keep_rows,keep_activation", [(True, True), (True, False), (False, True)])
def test_two_ops_give_the_single_ops_gradients(keep_rows, keep_activation, on_grouped_mm_path, monkeypatch):
    args = make_case(24, 2, 4, 32, 16, torch.float32, "skewed", seed=11)
    dy = torch.randn(24, 32, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    monkeypatch.setattr(config, "keep_activation", keep_activation)
    split, split_calls = _step(args, dy, keep_rows, monkeypatch, True)
    one, one_calls = _step(args, dy, keep_rows, monkeypatch, False)
    # the single op runs both halves through experts_backward; the split calls them as ops
    assert split_calls == ["backward_down", "backward_gate_up", "backward_weight_gate_up"]
    assert one_calls == ["experts_backward", "backward_down", "backward_gate_up", "backward_weight_gate_up"]
    want = dispatch.experts_backward(dy, *args)  # the kernels called directly, h, xs and aw recomputed
    for a, b, w in zip(split, one, want):
        assert torch.equal(a, b) and torch.equal(a, w)


@pytest.mark.parametrize("gate", ["relu2", "bias_interleaved", "limit_alpha"])
def test_two_ops_with_the_other_gates(gate, on_grouped_mm_path, monkeypatch):
    """Experts without a gate (d_h [S, I]), GPT-OSS's biases and interleaved rows (the bias gradient from the second
    op), clamped SwiGLU with the alpha gate: the two ops give the single op's bits."""
    T, k, E, H, I = 24, 2, 4, 32, 16
    x, ids, weights, w_gate_up, w_down = make_case(T, k, E, H, I, torch.float32, "skewed", seed=16)
    kw = {"relu2": {"epilogue": "relu2"},
          "bias_interleaved": {"gate_up_bias": torch.randn(E, 2 * I).to(DEVICE),
                               "epilogue": Epilogue(interleaved=True).encode()},
          "limit_alpha": {"epilogue": Epilogue(swiglu_limit=1.0, glu_alpha=1.702).encode()}}[gate]
    if gate == "relu2":
        w_gate_up = w_gate_up[:, :I].contiguous()  # the up projection [E, I, H]
    args = (x, ids, weights, w_gate_up, w_down)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(17)).to(DEVICE)
    split, split_calls = _step(args, dy, True, monkeypatch, True, **dict(kw))
    one, one_calls = _step(args, dy, True, monkeypatch, False, **dict(kw))
    assert split_calls == ["backward_down", "backward_gate_up", "backward_weight_gate_up"]
    assert one_calls[0] == "experts_backward"
    assert len(split) == len(one) == (5 if gate == "bias_interleaved" else 4)
    for a, b in zip(split, one):
        assert torch.equal(a, b)


def test_checkpointed_calls_keep_the_single_op(on_grouped_mm_path, monkeypatch):
    """Without a kept h (save_h False: a checkpointed layer) the backward recomputes inside one op, with one tile map
    for its four row-ragged GEMMs."""
    calls = []
    for name in ("experts_backward", "tile_map"):
        real = getattr(grouped_mm_path, name)
        monkeypatch.setattr(grouped_mm_path, name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    x, ids, weights, w_gate_up, w_down = make_case(12, 2, 4, 16, 8, torch.float32, seed=13)
    xg = x.detach().clone().requires_grad_()
    torch.ops.moe_fuse.experts(xg, ids, weights, w_gate_up, w_down, False)[0].sum().backward()
    assert calls == ["experts_backward", "tile_map"]


def test_opcheck(on_grouped_mm_path):
    """Schemas, fake implementations (the shapes and weight layouts the real ones return)."""
    T, k, E, H, I = 12, 2, 4, 16, 8
    args = make_case(T, k, E, H, I, torch.float32, seed=14)
    x, ids, weights, w_gate_up, w_down = args
    _, h, xs, routing, aw = torch.ops.moe_fuse.experts(*args, True)
    dy = torch.randn(T, H).to(DEVICE)
    down = (dy, x, ids, weights, w_gate_up, w_down, h, routing, aw, "silu")
    tests = ("test_schema", "test_faketensor")
    opcheck(torch.ops.moe_fuse.experts_backward_down.default, down, test_utils=tests)
    dh = torch.ops.moe_fuse.experts_backward_down(*down)[0]
    assert dh.shape == h.shape
    opcheck(torch.ops.moe_fuse.experts_backward_gate_up.default, (dh, x, ids, w_gate_up, w_down, routing),
            test_utils=tests)
    for kept in (xs, xs[:0]):  # xs kept, or gathered again
        opcheck(torch.ops.moe_fuse.experts_backward_weight_gate_up.default, (dh, x, ids, w_gate_up, w_down, kept,
                                                                             routing), test_utils=tests)


def test_the_halves_refuse_other_paths():
    """Off grouped_mm_path (here: the CPU without the test's stand-in) the halves name the op to call instead."""
    T, k, E, H, I = 8, 2, 4, 16, 8
    x, ids, weights, w_gate_up, w_down = make_case(T, k, E, H, I, torch.float32, seed=15)
    S = T * k
    h, routing = torch.randn(S, 2 * I).to(DEVICE), torch.zeros(0, dtype=torch.int32).to(DEVICE)
    with pytest.raises(RuntimeError, match="moe_fuse.experts_backward_down: a half of experts_backward on the "
                                           "grouped_mm path only .* call moe_fuse.experts_backward"):
        torch.ops.moe_fuse.experts_backward_down(torch.randn(T, H).to(DEVICE), x, ids, weights, w_gate_up, w_down, h,
                                                 routing, torch.zeros(0, I).to(DEVICE), "silu")
    with pytest.raises(RuntimeError, match="moe_fuse.experts_backward_gate_up: a half"):
        torch.ops.moe_fuse.experts_backward_gate_up(h, x, ids, w_gate_up, w_down, routing)
    with pytest.raises(RuntimeError, match="moe_fuse.experts_backward_weight_gate_up: a half"):
        torch.ops.moe_fuse.experts_backward_weight_gate_up(h, x, ids, w_gate_up, w_down, torch.zeros(0, H).to(DEVICE),
                                                           routing)


def test_the_switch_is_in_the_compile_cache_key():
    """config.split_backward is read when the backward is traced: a compile cached with the other setting is not
    reused."""
    from moe_fuse import backend

    split = backend.cache_tag()
    with config.patch(split_backward=False):
        one_op = backend.cache_tag()
    assert one_op != split and one_op.rsplit("-", 1)[0] == split.rsplit("-", 1)[0]  # same sources, other settings
    assert backend.cache_tag() == split
