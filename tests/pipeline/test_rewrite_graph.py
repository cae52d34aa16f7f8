"""The exact rewritten graph of one Qwen3-MoE block (fp32, transformers' fallback-op spelling): the router and the
experts both rewritten, the experts op reading the fused router's outputs."""

import expecttest
import torch

from support.compiled import rewritten_code
from support.models import qwen3_moe_config, randomize


class TestRewrittenGraph(expecttest.TestCase):
    def test_qwen3_moe_block(self):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = qwen3_moe_config()
        config._experts_implementation = "grouped_mm"
        block = randomize(Qwen3MoeSparseMoeBlock(config))
        self.assertExpectedInline(rewritten_code(block, torch.randn(2, 5, 32)), """\
def forward(self, L_hidden_states_ : torch.Tensor, L_self_modules_gate_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_experts_parameters_gate_up_proj_ : torch.nn.parameter.Parameter, L_self_modules_experts_parameters_down_proj_ : torch.nn.parameter.Parameter):
    l_hidden_states_ = L_hidden_states_
    l_self_modules_gate_parameters_weight_ = L_self_modules_gate_parameters_weight_
    l_self_modules_experts_parameters_gate_up_proj_ = L_self_modules_experts_parameters_gate_up_proj_
    l_self_modules_experts_parameters_down_proj_ = L_self_modules_experts_parameters_down_proj_
    hidden_states_reshaped = l_hidden_states_.view(-1, 32);  l_hidden_states_ = None
    hidden_states = hidden_states_reshaped.reshape(-1, 32)
    router_default = torch.ops.moe_fuse.router.default(hidden_states, l_self_modules_gate_parameters_weight_, 2, True, torch.float32);  hidden_states = l_self_modules_gate_parameters_weight_ = None
    getitem_11 = router_default[1]
    getitem_12 = router_default[2];  router_default = None
    experts_default = torch.ops.moe_fuse.experts.default(hidden_states_reshaped, getitem_12, getitem_11, l_self_modules_experts_parameters_gate_up_proj_, l_self_modules_experts_parameters_down_proj_, True);  hidden_states_reshaped = getitem_12 = getitem_11 = l_self_modules_experts_parameters_gate_up_proj_ = l_self_modules_experts_parameters_down_proj_ = None
    getitem_9 = experts_default[0];  experts_default = None
    reshape_3 = getitem_9.reshape(2, 5, 32);  getitem_9 = None
    return (reshape_3,)""")
