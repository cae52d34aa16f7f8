"""transformers' grouped_mm experts pattern in its spellings: torch.nn.functional.grouped_mm, weights stored
[E, in, out] (Aria), expert biases with interleaved gate / up rows (GPT-OSS), experts without a gate (Nemotron-H):
the exact rewritten graph, and GPT-OSS's block inside activation checkpointing."""

import json
import re
import tempfile
from pathlib import Path

import expecttest
import torch

from support import families
from support.compiled import assert_parity, compiled_step, matches, rewritten_code
from support.models import qwen3_moe_config, randomize
from moe_fuse.backend import moe_fuse_backend


def test_functional_grouped_mm_spelling(tmp_path):
    """torch.nn.functional.grouped_mm, as a graph shows it where Dynamo does not inline it to _grouped_mm."""
    import torch.nn.functional as F
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = qwen3_moe_config()
    config._experts_implementation = "grouped_mm"
    block = randomize(Qwen3MoeSparseMoeBlock(config)).to(torch.bfloat16)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    respelled = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.target is torch._grouped_mm:
                node.target = F.grouped_mm
                respelled.append(node.name)
        gm.recompile()
        options = {"moe_fuse.inner": "eager", "moe_fuse.debug_dir": str(tmp_path)}
        return moe_fuse_backend(gm, example_inputs, options=options)

    torch._dynamo.reset()
    got = torch.compile(block, backend=backend)(x)
    assert len(respelled) == 2
    (report,) = [json.loads(p.read_text()) for p in tmp_path.glob("graph_*/report.json")]
    assert sorted(m["pattern"] for m in report["matches"]) == ["grouped_mm_experts", "softmax_topk_router"]
    want = block(x)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 3e-2


class TestRewrittenTransposedGraph(expecttest.TestCase):
    def test_aria_block_weights_stored_transposed(self):
        """Aria stores its expert weights [E, in, out]: the op reads transposed views of the parameters."""
        model, _ = families.build("aria")
        block = model.model.layers[0].mlp
        H = model.config.hidden_size
        with tempfile.TemporaryDirectory() as debug_dir:
            code = rewritten_code(block, torch.randn(2, 5, H), **{"moe_fuse.debug_dir": debug_dir})
            (report,) = [json.loads(p.read_text()) for p in Path(debug_dir).glob("graph_*/report.json")]
        (experts,) = [m for m in report["matches"] if m["pattern"] == "grouped_mm_experts"]
        self.assertEqual(experts["notes"], ["expert weights stored [E, in, out]: the op reads transposed views (no copy)"])
        self.assertExpectedInline(code, """\
def forward(self, L_hidden_states_ : torch.Tensor, L_self_modules_router_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_experts_parameters_gate_up_proj_ : torch.nn.parameter.Parameter, L_self_modules_experts_parameters_down_proj_ : torch.nn.parameter.Parameter, L_self_modules_shared_experts_modules_gate_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_shared_experts_modules_up_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_shared_experts_modules_down_proj_parameters_weight_ : torch.nn.parameter.Parameter):
    l_hidden_states_ = L_hidden_states_
    l_self_modules_router_parameters_weight_ = L_self_modules_router_parameters_weight_
    l_self_modules_experts_parameters_gate_up_proj_ = L_self_modules_experts_parameters_gate_up_proj_
    l_self_modules_experts_parameters_down_proj_ = L_self_modules_experts_parameters_down_proj_
    l_self_modules_shared_experts_modules_gate_proj_parameters_weight_ = L_self_modules_shared_experts_modules_gate_proj_parameters_weight_
    l_self_modules_shared_experts_modules_up_proj_parameters_weight_ = L_self_modules_shared_experts_modules_up_proj_parameters_weight_
    l_self_modules_shared_experts_modules_down_proj_parameters_weight_ = L_self_modules_shared_experts_modules_down_proj_parameters_weight_
    hidden_states = l_hidden_states_.view(-1, 32);  l_hidden_states_ = None
    router_topk_softmax_default = torch.ops.moe_fuse.router_topk_softmax.default(hidden_states, l_self_modules_router_parameters_weight_, None, 2, 'fp32_inputs', torch.float32, 1.0, torch.float32);  l_self_modules_router_parameters_weight_ = None
    getitem_11 = router_topk_softmax_default[1]
    getitem_12 = router_topk_softmax_default[2];  router_topk_softmax_default = None
    transpose = l_self_modules_experts_parameters_gate_up_proj_.transpose(-2, -1);  l_self_modules_experts_parameters_gate_up_proj_ = None
    transpose_1 = l_self_modules_experts_parameters_down_proj_.transpose(-2, -1);  l_self_modules_experts_parameters_down_proj_ = None
    experts_default = torch.ops.moe_fuse.experts.default(hidden_states, getitem_12, getitem_11, transpose, transpose_1, True);  getitem_12 = getitem_11 = transpose = transpose_1 = None
    getitem_9 = experts_default[0];  experts_default = None
    expert_output = getitem_9.view((2, 5, 32));  getitem_9 = None
    view_3 = hidden_states.view((2, 5, 32));  hidden_states = None
    linear_1 = torch._C._nn.linear(view_3, l_self_modules_shared_experts_modules_gate_proj_parameters_weight_, None);  l_self_modules_shared_experts_modules_gate_proj_parameters_weight_ = None
    silu_1 = torch.nn.functional.silu(linear_1);  linear_1 = None
    linear_2 = torch._C._nn.linear(view_3, l_self_modules_shared_experts_modules_up_proj_parameters_weight_, None);  view_3 = l_self_modules_shared_experts_modules_up_proj_parameters_weight_ = None
    mul_2 = silu_1 * linear_2;  silu_1 = linear_2 = None
    down_proj = torch._C._nn.linear(mul_2, l_self_modules_shared_experts_modules_down_proj_parameters_weight_, None);  mul_2 = l_self_modules_shared_experts_modules_down_proj_parameters_weight_ = None
    add = expert_output + down_proj;  expert_output = down_proj = None
    return (add,)""")


class TestRewrittenBiasedGraph(expecttest.TestCase):
    def test_gpt_oss_block_biases_and_interleaved_rows(self):
        """GPT-OSS: the op with the gate_up bias and interleaved rows, the down bias's routing-weighted GEMM after
        it, the weights as transposed views."""
        model, _ = families.build("gpt_oss")
        block = model.model.layers[0].mlp
        H = model.config.hidden_size
        code = rewritten_code(block, torch.randn(2, 5, H))
        self.assertExpectedInline(code, """\
def forward(self, L_hidden_states_ : torch.Tensor, L_self_modules_router_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_router_parameters_bias_ : torch.nn.parameter.Parameter, L_self_modules_experts_parameters_gate_up_proj_ : torch.nn.parameter.Parameter, L_self_modules_experts_parameters_gate_up_proj_bias_ : torch.nn.parameter.Parameter, L_self_modules_experts_parameters_down_proj_ : torch.nn.parameter.Parameter, L_self_modules_experts_parameters_down_proj_bias_ : torch.nn.parameter.Parameter):
    l_hidden_states_ = L_hidden_states_
    l_self_modules_router_parameters_weight_ = L_self_modules_router_parameters_weight_
    l_self_modules_router_parameters_bias_ = L_self_modules_router_parameters_bias_
    l_self_modules_experts_parameters_gate_up_proj_ = L_self_modules_experts_parameters_gate_up_proj_
    l_self_modules_experts_parameters_gate_up_proj_bias_ = L_self_modules_experts_parameters_gate_up_proj_bias_
    l_self_modules_experts_parameters_down_proj_ = L_self_modules_experts_parameters_down_proj_
    l_self_modules_experts_parameters_down_proj_bias_ = L_self_modules_experts_parameters_down_proj_bias_
    hidden_states = l_hidden_states_.reshape(-1, 32);  l_hidden_states_ = None
    router_topk_softmax_default = torch.ops.moe_fuse.router_topk_softmax.default(hidden_states, l_self_modules_router_parameters_weight_, l_self_modules_router_parameters_bias_, 2, 'fp32_inputs', torch.float32, 1.0, torch.float32);  l_self_modules_router_parameters_weight_ = l_self_modules_router_parameters_bias_ = None
    getitem_15 = router_topk_softmax_default[1]
    getitem_16 = router_topk_softmax_default[2];  router_topk_softmax_default = None
    transpose = l_self_modules_experts_parameters_gate_up_proj_.transpose(-2, -1);  l_self_modules_experts_parameters_gate_up_proj_ = None
    transpose_1 = l_self_modules_experts_parameters_down_proj_.transpose(-2, -1);  l_self_modules_experts_parameters_down_proj_ = None
    experts_default = torch.ops.moe_fuse.experts.default(hidden_states, getitem_16, getitem_15, transpose, transpose_1, True, 'silu(swiglu_limit=7.0, glu_alpha=1.702, interleaved=True)', l_self_modules_experts_parameters_gate_up_proj_bias_);  hidden_states = transpose = transpose_1 = l_self_modules_experts_parameters_gate_up_proj_bias_ = None
    getitem_11 = experts_default[0];  experts_default = None
    to_3 = getitem_11.to(torch.float32);  getitem_11 = None
    to_4 = l_self_modules_experts_parameters_down_proj_bias_.to(torch.float32);  l_self_modules_experts_parameters_down_proj_bias_ = None
    getattr_1 = getitem_15.shape
    getitem_12 = getattr_1[0];  getattr_1 = None
    getattr_2 = to_4.dtype
    new_zeros = getitem_15.new_zeros(getitem_12, 5, dtype = getattr_2);  getitem_12 = getattr_2 = None
    clamp_2 = getitem_16.clamp(max = 4);  getitem_16 = None
    getattr_3 = to_4.dtype
    to_5 = getitem_15.to(getattr_3);  getattr_3 = None
    scatter_add = new_zeros.scatter_add(1, clamp_2, to_5);  new_zeros = clamp_2 = to_5 = None
    getitem_13 = scatter_add[(slice(None, None, None), slice(None, 4, None))];  scatter_add = None
    matmul = getitem_13 @ to_4;  getitem_13 = to_4 = None
    add_1 = to_3 + matmul;  to_3 = matmul = None
    to_6 = add_1.to(torch.float32);  add_1 = None
    hidden_states_2 = to_6.reshape(2, 5, 32);  to_6 = None
    return (hidden_states_2, getitem_15)""")


class TestRewrittenUngatedGraph(expecttest.TestCase):
    def test_nemotron_h_block_experts_without_a_gate(self):
        """Nemotron-H's experts have an up projection only and a squared ReLU: one experts op with "relu2"."""
        model, _ = families.build("nemotron_h")
        block = model.model.layers[1].mixer  # layers: mamba, MoE, attention, MoE
        H = model.config.hidden_size
        self.assertExpectedInline(rewritten_code(block, torch.randn(2, 5, H)), """\
def forward(self, L_hidden_states_ : torch.Tensor, L_self_modules_gate_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_gate_buffers_e_score_correction_bias_ : torch.Tensor, L_self_modules_experts_parameters_up_proj_ : torch.nn.parameter.Parameter, L_self_modules_experts_parameters_down_proj_ : torch.nn.parameter.Parameter, L_self_modules_shared_experts_modules_up_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_shared_experts_modules_down_proj_parameters_weight_ : torch.nn.parameter.Parameter):
    l_hidden_states_ = L_hidden_states_
    l_self_modules_gate_parameters_weight_ = L_self_modules_gate_parameters_weight_
    l_self_modules_gate_buffers_e_score_correction_bias_ = L_self_modules_gate_buffers_e_score_correction_bias_
    l_self_modules_experts_parameters_up_proj_ = L_self_modules_experts_parameters_up_proj_
    l_self_modules_experts_parameters_down_proj_ = L_self_modules_experts_parameters_down_proj_
    l_self_modules_shared_experts_modules_up_proj_parameters_weight_ = L_self_modules_shared_experts_modules_up_proj_parameters_weight_
    l_self_modules_shared_experts_modules_down_proj_parameters_weight_ = L_self_modules_shared_experts_modules_down_proj_parameters_weight_
    hidden_states = l_hidden_states_.view(-1, 32)
    router_sigmoid_default = torch.ops.moe_fuse.router_sigmoid.default(hidden_states, l_self_modules_gate_parameters_weight_, l_self_modules_gate_buffers_e_score_correction_bias_, 2, 1, 1, False, False, True, 1e-20, 1.0, 'fp32_inputs', torch.float32);  hidden_states = l_self_modules_gate_parameters_weight_ = l_self_modules_gate_buffers_e_score_correction_bias_ = None
    getitem_13 = router_sigmoid_default[1]
    getitem_14 = router_sigmoid_default[2];  router_sigmoid_default = None
    hidden_states_1 = l_hidden_states_.view(-1, 32)
    experts_default = torch.ops.moe_fuse.experts.default(hidden_states_1, getitem_14, getitem_13, l_self_modules_experts_parameters_up_proj_, l_self_modules_experts_parameters_down_proj_, True, 'relu2');  hidden_states_1 = getitem_14 = getitem_13 = l_self_modules_experts_parameters_up_proj_ = l_self_modules_experts_parameters_down_proj_ = None
    getitem_11 = experts_default[0];  experts_default = None
    hidden_states_3 = getitem_11.view(2, 5, 32);  getitem_11 = None
    linear_1 = torch._C._nn.linear(l_hidden_states_, l_self_modules_shared_experts_modules_up_proj_parameters_weight_, None);  l_hidden_states_ = l_self_modules_shared_experts_modules_up_proj_parameters_weight_ = None
    relu_applied_1 = torch.nn.functional.relu(linear_1);  linear_1 = None
    squared_1 = torch.square(relu_applied_1);  relu_applied_1 = None
    linear_2 = torch._C._nn.linear(squared_1, l_self_modules_shared_experts_modules_down_proj_parameters_weight_, None);  squared_1 = l_self_modules_shared_experts_modules_down_proj_parameters_weight_ = None
    hidden_states_4 = hidden_states_3 + linear_2;  hidden_states_3 = linear_2 = None
    return (hidden_states_4,)""")


def test_checkpointed_gpt_oss_block_recomputes_h(tmp_path):
    """GPT-OSS's experts (biases, interleaved gate / up rows) inside activation checkpointing keep no h for the
    backward (save_h False), as every experts call there: the backward recomputes the block anyway."""
    model, inputs = families.build("gpt_oss", output_router_logits=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    eager, fused, reports = compiled_step(model, inputs, tmp_path)
    experts = matches(reports, "grouped_mm_experts")
    assert len(experts) == 2 and all("wrap_body" in m["where"] for m in experts), experts
    after = "".join(p.read_text() for p in sorted(tmp_path.glob("graph_*/after.py")))
    # moe_fuse.experts(x, ids, weights, W_gate_up, W_down, save_h, epilogue, gate_up_bias)
    calls = re.findall(r"torch\.ops\.moe_fuse\.experts\.default\((?:[^,()]+, ){5}(True|False), "
                       r"'silu\(swiglu_limit=7\.0, glu_alpha=1\.702, interleaved=True\)', [^,();]+\)", after)
    assert calls == ["False"] * 2, after
    assert_parity(eager, fused, tol=families.TOLERANCE, output=False)
