"""The top-k-then-softmax router pattern (GPT-OSS, Granite-MoE) on tiny transformers models: parity of outputs
and every gradient with eager, the fused op in the rewritten graph."""

import pytest
import torch

from support import families as F
from support.compiled import assert_parity, compiled_step, matches, op_lines, rejected, rewritten_code


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_gpt_oss(tmp_path):
    model, inputs = F.build("gpt_oss")
    eager, fused, reports = compiled_step(model, inputs, tmp_path)
    assert_parity(eager, fused)
    assert eager[2] is not None and F.rel_err(fused[2], eager[2]) < 1e-5  # the aux loss reads the logits
    routers = matches(reports, "topk_softmax_router")
    assert len(routers) == 2 and all(m["linear_bias"] and m["top_k"] == 2 for m in routers)
    assert not rejected(reports, "unmatched_router") and not rejected(reports, "topk_softmax_router")


def test_granitemoe(tmp_path):
    model, inputs = F.build("granitemoe")
    eager, fused, reports = compiled_step(model, inputs, tmp_path)
    assert_parity(eager, fused)
    routers = matches(reports, "topk_softmax_router")
    assert len(routers) == 2 and all(not m["linear_bias"] and m["logits_mode"] == "fp32_inputs" for m in routers)


def test_router_topk_softmax_in_the_graph():
    model, _ = F.build("gpt_oss")
    block = model.model.layers[0].mlp
    code = rewritten_code(block, torch.randn(2, 5, 32))
    assert op_lines(code, "router_topk_softmax") == [
        "router_topk_softmax_default = torch.ops.moe_fuse.router_topk_softmax.default(hidden_states, weight, "
        "bias, 2, 'fp32_inputs', torch.float32, 1.0, torch.float32)"
    ]
    assert "torch.topk" not in code and "softmax(" not in code.replace("router_topk_softmax", "")
