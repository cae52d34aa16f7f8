"""Dense experts (Llama 4): every token through every expert, scored 0 off its top-k. The rewrite runs the k
chosen experts only (moe_fuse.experts on pre-scaled rows); the step must stay eager's."""

import json
import re
import tempfile
from pathlib import Path

import expecttest
import pytest
import torch
import torch.nn as nn

from support import families
from support.compiled import assert_parity, compiled_step, rewritten_code

from moe_fuse import explain


def dense_entries(reports, key):
    return [e for r in reports for e in r[key] if e["pattern"] == "dense_experts"]


def llama4_block(**overrides):
    model, _ = families.build("llama4", **overrides)
    return model.model.layers[0].feed_forward


def block_step(block, x, dy):
    """y and the gradients of x and every parameter, for a block returning (y, router_logits)."""
    x = x.detach().requires_grad_(True)
    y = block(x)[0]
    grads = torch.autograd.grad(y, [x, *block.parameters()], dy)
    return y.detach(), grads


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_matches_eager(top_k, dtype):
    block = llama4_block(num_experts_per_tok=top_k).to(dtype)
    x = torch.randn(2, 7, block.hidden_dim).to(dtype)
    dy = torch.randn(2 * 7, block.hidden_dim).to(dtype)
    want = block_step(block, x, dy)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="moe_fuse", options={"moe_fuse.inner": "aot_eager"})
    got = block_step(compiled, x, dy)
    torch._dynamo.reset()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    names = ["y", "x", *(n for n, _ in block.named_parameters())]
    for name, g, w in zip(names, [got[0], *got[1]], [want[0], *want[1]]):
        assert families.rel_err(g, w) < tol, name
    report = explain(block, x)
    (match,) = report.matches
    assert match["pattern"] == "dense_experts" and match["top_k"] == top_k and match["num_experts"] == 4


class TestRewrittenDenseGraph(expecttest.TestCase):
    def test_llama4_block(self):
        """The router's top-k, the -inf scatter, the repeat and both bmms over all experts become one top-k and
        moe_fuse.experts on the k chosen rows per token; the router logits and the shared expert stay."""
        block = llama4_block()
        with tempfile.TemporaryDirectory() as debug_dir:
            code = rewritten_code(block, torch.randn(2, 5, block.hidden_dim), **{"moe_fuse.debug_dir": debug_dir})
            (report,) = [json.loads(p.read_text()) for p in Path(debug_dir).glob("graph_*/report.json")]
        (match,) = dense_entries([report], "matches")
        self.assertEqual(match["notes"], ["every token ran through all 4 experts (scores 0 off the top-2); the fused "
                                          "op computes the 2 chosen ones only (2x fewer expert FLOPs)"])
        self.assertEqual(report["rejected"], [])
        self.assertExpectedInline(code, """\
def forward(self, L_hidden_states_ : torch.Tensor, L_self_modules_router_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_experts_parameters_gate_up_proj_ : torch.nn.parameter.Parameter, L_self_modules_experts_parameters_down_proj_ : torch.nn.parameter.Parameter, L_self_modules_shared_expert_modules_gate_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_shared_expert_modules_up_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_shared_expert_modules_down_proj_parameters_weight_ : torch.nn.parameter.Parameter):
    l_hidden_states_ = L_hidden_states_
    l_self_modules_router_parameters_weight_ = L_self_modules_router_parameters_weight_
    l_self_modules_experts_parameters_gate_up_proj_ = L_self_modules_experts_parameters_gate_up_proj_
    l_self_modules_experts_parameters_down_proj_ = L_self_modules_experts_parameters_down_proj_
    l_self_modules_shared_expert_modules_gate_proj_parameters_weight_ = L_self_modules_shared_expert_modules_gate_proj_parameters_weight_
    l_self_modules_shared_expert_modules_up_proj_parameters_weight_ = L_self_modules_shared_expert_modules_up_proj_parameters_weight_
    l_self_modules_shared_expert_modules_down_proj_parameters_weight_ = L_self_modules_shared_expert_modules_down_proj_parameters_weight_
    hidden_states = l_hidden_states_.reshape(-1, 32);  l_hidden_states_ = None
    router_logits = torch._C._nn.linear(hidden_states, l_self_modules_router_parameters_weight_, None);  l_self_modules_router_parameters_weight_ = None
    topk_1 = torch.topk(router_logits, 2, dim = -1, sorted = True)
    getitem_4 = topk_1[0]
    getitem_5 = topk_1[1];  topk_1 = None
    float_2 = getitem_4.float();  getitem_4 = None
    sigmoid_1 = torch.sigmoid(float_2);  float_2 = None
    to_1 = sigmoid_1.to(torch.float32);  sigmoid_1 = None
    unsqueeze = hidden_states.unsqueeze(1)
    unsqueeze_1 = to_1.unsqueeze(-1);  to_1 = None
    mul_3 = unsqueeze * unsqueeze_1;  unsqueeze = unsqueeze_1 = None
    reshape_3 = mul_3.reshape(-1, 32);  mul_3 = None
    reshape_4 = getitem_5.reshape(-1, 1);  getitem_5 = None
    ones_like = torch.ones_like(reshape_4, dtype = torch.float32)
    transpose_1 = l_self_modules_experts_parameters_gate_up_proj_.transpose(-2, -1);  l_self_modules_experts_parameters_gate_up_proj_ = None
    transpose_2 = l_self_modules_experts_parameters_down_proj_.transpose(-2, -1);  l_self_modules_experts_parameters_down_proj_ = None
    experts_default = torch.ops.moe_fuse.experts.default(reshape_3, reshape_4, ones_like, transpose_1, transpose_2, True);  reshape_3 = reshape_4 = ones_like = transpose_1 = transpose_2 = None
    getitem_6 = experts_default[0];  experts_default = None
    view_2 = getitem_6.view(-1, 2, 32);  getitem_6 = None
    sum_2 = view_2.sum(dim = 1);  view_2 = None
    linear_1 = torch._C._nn.linear(hidden_states, l_self_modules_shared_expert_modules_gate_proj_parameters_weight_, None);  l_self_modules_shared_expert_modules_gate_proj_parameters_weight_ = None
    silu_1 = torch.nn.functional.silu(linear_1);  linear_1 = None
    linear_2 = torch._C._nn.linear(hidden_states, l_self_modules_shared_expert_modules_up_proj_parameters_weight_, None);  hidden_states = l_self_modules_shared_expert_modules_up_proj_parameters_weight_ = None
    down_proj = silu_1 * linear_2;  silu_1 = linear_2 = None
    out = torch._C._nn.linear(down_proj, l_self_modules_shared_expert_modules_down_proj_parameters_weight_, None);  down_proj = l_self_modules_shared_expert_modules_down_proj_parameters_weight_ = None
    add_ = out.add_(sum_2);  sum_2 = add_ = None
    return (out, router_logits)""")


def test_llama4_model_step_is_eagers_and_fused(tmp_path):
    eager, fused, reports = compiled_step(*families.build("llama4"), tmp_path)
    assert len(dense_entries(reports, "matches")) == 2
    assert not dense_entries(reports, "rejected")
    assert_parity(eager, fused, tol=families.TOLERANCE)


def test_checkpointed_layers_recompute_h(tmp_path):
    """Inside activation checkpointing the rewrite turns save_h off for the dense form too."""
    model, inputs = families.build("llama4", output_router_logits=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    eager, fused, reports = compiled_step(model, inputs, tmp_path)
    after = "".join(p.read_text() for p in sorted(tmp_path.glob("graph_*/after.py")))
    calls = re.findall(r"torch\.ops\.moe_fuse\.experts\.default\([^;]*, (True|False)\)", after)
    assert calls == ["False"] * 2, calls
    assert_parity(eager, fused, tol=families.TOLERANCE, output=False)


class Dense(nn.Module):
    """Llama 4's dense experts with the score spelling as a parameter: what the pattern must refuse."""

    def __init__(self, scores="topk", E=4, k=2, H=16, I=8):
        super().__init__()
        self.scores, self.E, self.k, self.H = scores, E, k, H
        self.router = nn.Linear(H, E, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E, H, 2 * I) * H**-0.5)
        self.down = nn.Parameter(torch.randn(E, I, H) * I**-0.5)

    def forward(self, x):
        logits = self.router(x)
        if self.scores == "softmax":  # every expert gets a nonzero weight: truly dense
            scores = logits.softmax(dim=-1)
        else:
            values, ids = torch.topk(logits, self.k, dim=1)
            fill = 0.0 if self.scores == "zero_fill" else float("-inf")
            scores = torch.full_like(logits, fill).scatter_(1, ids, values).float().sigmoid().to(logits.dtype)
        rows = x.repeat(self.E, 1) * scores.transpose(0, 1).reshape(-1, 1)
        gate, up = torch.bmm(rows.view(self.E, -1, self.H), self.gate_up).chunk(2, dim=-1)
        out = torch.bmm(up * nn.functional.silu(gate), self.down)
        return out.view(-1, self.H).reshape(self.E, -1, self.H).sum(dim=0)


@pytest.mark.parametrize("scores,reason", [
    ("softmax", "scores from softmax, expected sigmoid of scattered top-k logits"),
    ("zero_fill", "off-top-k scores filled with 0.0, expected -inf (sigmoid 0: those experts see zero rows)"),
])
def test_dense_blocks_that_are_not_top_k_are_left_alone(scores, reason):
    torch.manual_seed(0)
    block = Dense(scores)
    x = torch.randn(6, 16)
    report = explain(block, x)
    assert not report.matches
    assert [r["reason"] for r in report.rejected if r["pattern"] == "dense_experts"] == [reason]
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="moe_fuse", options={"moe_fuse.inner": "aot_eager"})
    assert torch.equal(compiled(x), block(x))
    torch._dynamo.reset()


def test_the_same_block_with_top_k_scores_is_fused():
    """The control for the refusals above: the module itself is in the pattern."""
    torch.manual_seed(0)
    block = Dense("topk")
    x = torch.randn(6, 16)
    (match,) = explain(block, x).matches
    assert match["pattern"] == "dense_experts"


def test_symbolic_token_count(tmp_path):
    """dynamic=True: one graph with a symbolic T serves two token counts, fused, with eager's results."""
    block = llama4_block()
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": str(tmp_path)}
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="moe_fuse", dynamic=True, options=options)
    for T in (5, 9):
        x = torch.randn(1, T, block.hidden_dim)
        dy = torch.randn(T, block.hidden_dim)
        got, want = block_step(compiled, x, dy), block_step(block, x, dy)
        for g, w in zip([got[0], *got[1]], [want[0], *want[1]]):
            assert families.rel_err(g, w) < 1e-5
    torch._dynamo.reset()
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("graph_*/report.json"))]
    assert len(reports) == 1 and len(dense_entries(reports, "matches")) == 1
    after = next(tmp_path.glob("graph_*/after.py")).read_text()
    assert "torch.ops.moe_fuse.experts.default(" in after and "torch.bmm" not in after
