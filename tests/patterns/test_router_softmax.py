"""The softmax -> top-k router pattern in a spelling beyond Qwen3's: Mixtral's softmax(logits.float()) with fp32
routing weights."""

import json

import pytest
import torch

from support.models import loss_and_grads, randomize, rel_err, token_batch


def tiny_mixtral(dtype):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=6, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.01,
    )
    torch.manual_seed(0)
    return randomize(MixtralForCausalLM(config)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixtral(dtype, tmp_path):
    torch._dynamo.reset()
    model = tiny_mixtral(dtype)
    ids = token_batch()
    eager = loss_and_grads(model, ids)
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": str(tmp_path)}
    fused = loss_and_grads(torch.compile(model, backend="moe_fuse", options=options), ids)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for a, b in zip(eager[:3], fused[:3]):
        assert rel_err(b, a) < tol
    for name in eager[3]:
        assert rel_err(fused[3][name], eager[3][name]) < tol, name

    (report,) = [r for r in map(json.loads, (p.read_text() for p in tmp_path.glob("graph_*/report.json")))
                 if r["matches"]]
    routers = [m for m in report["matches"] if m["pattern"] == "softmax_topk_router"]
    experts = [m for m in report["matches"] if m["pattern"] == "grouped_mm_experts"]
    assert len(routers) == 2 and len(experts) == 2
    assert all(m["weights_dtype"] == "float32" and m["renorm"] for m in routers)  # Mixtral keeps fp32 weights
    assert all(m["weights_dtype"] == "float32" for m in experts)
    torch._dynamo.reset()
