"""The DeepSeek-V3 router pattern (sigmoid scores, a selection bias, group-limited selection) on tiny
transformers models: parity of outputs and every gradient with eager, the fused op in the rewritten graph, near
misses left alone with the reason."""

import pytest
import torch

from support import families as F
from support.compiled import assert_parity, compiled_step, matches, op_lines, rejected, rewritten_code
import moe_fuse


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _randomize_selection_bias(model, seed=3):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.2)


def deepseek_v3(**overrides):
    args = dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3, norm_topk_prob=True,
                routed_scaling_factor=2.5)
    model, inputs = F.build("deepseek_v3", **{**args, **overrides})
    _randomize_selection_bias(model)
    return model, inputs


@pytest.mark.parametrize("renorm,scale", [(True, 2.5), (False, 1.0), (False, 0.5)])
def test_deepseek_v3_grouped(renorm, scale, tmp_path):
    model, inputs = deepseek_v3(norm_topk_prob=renorm, routed_scaling_factor=scale)
    eager, fused, reports = compiled_step(model, inputs, tmp_path)
    assert_parity(eager, fused)
    routers = matches(reports, "sigmoid_topk_router")
    assert len(routers) == 2, rejected(reports)
    for m in routers:
        assert (m["num_experts"], m["top_k"], m["n_group"], m["topk_group"]) == (8, 3, 4, 2)
        assert m["renorm"] is renorm and m["scale"] == scale and m["eps"] == (1e-20 if renorm else 0.0)
        assert m["verified"] and m["weights_dtype"] == "float32"
    assert len(matches(reports, "grouped_mm_experts")) == 2
    assert not rejected(reports, "unmatched_router") and not rejected(reports, "sigmoid_topk_router")


def test_deepseek_v3_one_group_kept_bf16(tmp_path):
    model, inputs = deepseek_v3(n_group=2, topk_group=1, num_experts_per_tok=2)
    model = model.to(torch.bfloat16)
    eager, fused, reports = compiled_step(model, inputs, tmp_path)
    assert_parity(eager, fused, tol=2e-2)
    assert F.rel_err(fused[0], eager[0]) < 1e-3
    routers = matches(reports, "sigmoid_topk_router")
    assert len(routers) == 2 and all(m["dtype"] == "bfloat16" and m["n_group"] == 2 for m in routers)


# --------------------------------------------------------------------------- the rewritten graph


def test_router_sigmoid_in_the_graph():
    model, _ = deepseek_v3()
    block = model.model.layers[0].mlp
    x = torch.randn(2, 5, 32)
    code = rewritten_code(block, x)
    assert op_lines(code, "router_sigmoid") == [
        "router_sigmoid_default = torch.ops.moe_fuse.router_sigmoid.default(hidden_states, weight, "
        "e_score_correction_bias, 3, 4, 2, False, False, True, 1e-20, 2.5, 'fp32_inputs', torch.float32)"
    ]
    assert ".sigmoid()" not in code and "masked_fill" not in code and "scatter_" not in code
    assert "torch.ops.moe_fuse.experts" in code
    want = block(x)
    torch._dynamo.reset()
    got = torch.compile(block, backend="moe_fuse", options={"moe_fuse.inner": "eager"})(x)
    assert F.rel_err(got, want) < 1e-5


# --------------------------------------------------------------------------- near misses


def _patch_router(model, forward):
    for module in model.modules():
        if type(module).__name__ == "DeepseekV3TopkRouter":
            module.forward = forward.__get__(module)


def _near_miss_router(self, hidden_states, per_group=3, fill=float("-inf")):
    """DeepSeek-V3's router with the group score as a top-3 sum instead of top-2."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
    scores = router_logits.sigmoid()
    scores_for_choice = scores + self.e_score_correction_bias
    group_scores = (
        scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(per_group, dim=-1)[0]
        .sum(dim=-1)
    )
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group)
        .reshape(-1, self.num_experts)
    )
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), fill)
    topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
    topk_weights = topk_weights * self.routed_scaling_factor
    return router_logits, topk_weights, topk_indices


@pytest.mark.parametrize("change,reason", [
    (dict(per_group=3), "group score is the top-3 sum of each group, expected top-2"),
    (dict(fill=-1e4), "masked_fill value -10000.0, expected -inf"),
])
def test_near_miss_is_left_alone(change, reason, tmp_path):
    model, inputs = deepseek_v3(n_group=2, topk_group=1, num_experts_per_tok=2)  # groups of 4
    _patch_router(model, lambda self, h: _near_miss_router(self, h, **change))
    eager, fused, reports = compiled_step(model, inputs, tmp_path)
    assert_parity(eager, fused)
    assert not matches(reports, "sigmoid_topk_router")
    lines = rejected(reports, "sigmoid_topk_router")
    assert len(lines) == 2 and all(x["reason"] == reason for x in lines), lines
    assert all("mlp.gate" in x["where"] for x in lines)


def test_dynamic_token_count():
    model, _ = deepseek_v3()
    block = model.model.layers[0].mlp
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="moe_fuse", dynamic=True, options={"moe_fuse.inner": "eager"})
    with moe_fuse.debug.collect_reports() as reports:
        for tokens in (5, 7):
            x = torch.randn(2, tokens, 32)
            assert F.rel_err(compiled(x), block(x)) < 1e-5
    assert [m["pattern"] for r in reports for m in r.matches].count("sigmoid_topk_router") == 1
