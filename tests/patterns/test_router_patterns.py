"""The DeepSeek-V3 (sigmoid, selection bias, group-limited) and GPT-OSS (top-k, then softmax) router
patterns on tiny transformers models: parity of outputs and every gradient with eager, the fused op
in the rewritten graph, near misses left alone with the reason, and report lines for routers no
pattern takes."""

import json
import re

import pytest
import torch

from support import families as F
import moe_fuse
from moe_fuse.backend import moe_fuse_backend


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


def compiled_step(model, inputs, tmp_path, dtype=torch.float32, **options):
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": str(tmp_path), **options}
    eager = F.loss_and_grads(model, inputs)
    torch._dynamo.reset()
    fused = F.loss_and_grads(torch.compile(model, backend="moe_fuse", options=options), inputs)
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("graph_*/report.json"))]
    return eager, fused, reports


def assert_parity(eager, fused, tol=1e-5):
    for what, a, b in (("loss", eager[0], fused[0]), ("output", eager[1], fused[1])):
        assert F.rel_err(b, a) < tol, what
    assert eager[3].keys() == fused[3].keys()
    for name in eager[3]:
        assert F.rel_err(fused[3][name], eager[3][name]) < tol, name


def _matches(reports, pattern):
    return [m for r in reports for m in r["matches"] if m["pattern"] == pattern]


def _rejected(reports, pattern=None):
    return [x for r in reports for x in r["rejected"] if pattern is None or x["pattern"] == pattern]


@pytest.mark.parametrize("renorm,scale", [(True, 2.5), (False, 1.0), (False, 0.5)])
def test_deepseek_v3_grouped(renorm, scale, tmp_path):
    model, inputs = deepseek_v3(norm_topk_prob=renorm, routed_scaling_factor=scale)
    eager, fused, reports = compiled_step(model, inputs, tmp_path)
    assert_parity(eager, fused)
    routers = _matches(reports, "sigmoid_topk_router")
    assert len(routers) == 2, _rejected(reports)
    for m in routers:
        assert (m["num_experts"], m["top_k"], m["n_group"], m["topk_group"]) == (8, 3, 4, 2)
        assert m["renorm"] is renorm and m["scale"] == scale and m["eps"] == (1e-20 if renorm else 0.0)
        assert m["verified"] and m["weights_dtype"] == "float32"
    assert len(_matches(reports, "grouped_mm_experts")) == 2
    assert not _rejected(reports, "unmatched_router") and not _rejected(reports, "sigmoid_topk_router")


def test_deepseek_v3_one_group_kept_bf16(tmp_path):
    model, inputs = deepseek_v3(n_group=2, topk_group=1, num_experts_per_tok=2)
    model = model.to(torch.bfloat16)
    eager, fused, reports = compiled_step(model, inputs, tmp_path)
    assert_parity(eager, fused, tol=2e-2)
    assert F.rel_err(fused[0], eager[0]) < 1e-3
    routers = _matches(reports, "sigmoid_topk_router")
    assert len(routers) == 2 and all(m["dtype"] == "bfloat16" and m["n_group"] == 2 for m in routers)


def test_gpt_oss(tmp_path):
    model, inputs = F.build("gpt_oss")
    eager, fused, reports = compiled_step(model, inputs, tmp_path)
    assert_parity(eager, fused)
    assert eager[2] is not None and F.rel_err(fused[2], eager[2]) < 1e-5  # the aux loss reads the logits
    routers = _matches(reports, "topk_softmax_router")
    assert len(routers) == 2 and all(m["linear_bias"] and m["top_k"] == 2 for m in routers)
    assert not _rejected(reports, "unmatched_router") and not _rejected(reports, "topk_softmax_router")


def test_granitemoe(tmp_path):
    model, inputs = F.build("granitemoe")
    eager, fused, reports = compiled_step(model, inputs, tmp_path)
    assert_parity(eager, fused)
    routers = _matches(reports, "topk_softmax_router")
    assert len(routers) == 2 and all(not m["linear_bias"] and m["logits_mode"] == "fp32_inputs" for m in routers)


# --------------------------------------------------------------------------- the rewritten graph


def rewritten_code(block, x) -> str:
    captured = []

    def backend(gm, example_inputs):
        compiled = moe_fuse_backend(gm, example_inputs, options={"moe_fuse.inner": "eager"})
        captured.append(gm)
        return compiled

    torch._dynamo.reset()
    torch.compile(block, backend=backend)(x)
    (gm,) = captured
    return gm.code


def _op_lines(code: str, op: str) -> list[str]:
    lines = [line.strip().split(";")[0] for line in code.splitlines() if f"torch.ops.moe_fuse.{op}" in line]
    return [re.sub(r"l_self_modules_\w+?_(weight|bias|e_score_correction_bias)_\b", r"\1", line) for line in lines]


def test_router_sigmoid_in_the_graph():
    model, _ = deepseek_v3()
    block = model.model.layers[0].mlp
    x = torch.randn(2, 5, 32)
    code = rewritten_code(block, x)
    assert _op_lines(code, "router_sigmoid") == [
        "router_sigmoid_default = torch.ops.moe_fuse.router_sigmoid.default(hidden_states, weight, "
        "e_score_correction_bias, 3, 4, 2, False, False, True, 1e-20, 2.5, 'fp32_inputs', torch.float32)"
    ]
    assert ".sigmoid()" not in code and "masked_fill" not in code and "scatter_" not in code
    assert "torch.ops.moe_fuse.experts" in code
    want = block(x)
    torch._dynamo.reset()
    got = torch.compile(block, backend="moe_fuse", options={"moe_fuse.inner": "eager"})(x)
    assert F.rel_err(got, want) < 1e-5


def test_router_topk_softmax_in_the_graph():
    model, _ = F.build("gpt_oss")
    block = model.model.layers[0].mlp
    code = rewritten_code(block, torch.randn(2, 5, 32))
    assert _op_lines(code, "router_topk_softmax") == [
        "router_topk_softmax_default = torch.ops.moe_fuse.router_topk_softmax.default(hidden_states, weight, "
        "bias, 2, 'fp32_inputs', torch.float32, 1.0, torch.float32)"
    ]
    assert "torch.topk" not in code and "softmax(" not in code.replace("router_topk_softmax", "")


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
    assert not _matches(reports, "sigmoid_topk_router")
    rejected = _rejected(reports, "sigmoid_topk_router")
    assert len(rejected) == 2 and all(x["reason"] == reason for x in rejected), rejected
    assert all("mlp.gate" in x["where"] for x in rejected)


# --------------------------------------------------------------------------- routers no pattern takes


@pytest.mark.parametrize("family,op,reason", [
    ("kolibri1", "add", "router-like top-k over linear → add → topk: add of the logits fits no router pattern"),
    ("flint", "topk", "router-like top-k over linear → sigmoid → topk: sigmoid_topk_router expects sigmoid scores "
                      "+ a selection bias, then top-k; the top-k comes after sigmoid"),
    ("inkling", "routed_scores", "router-like top-k over linear → sigmoid → getitem → add → topk: sigmoid_topk_router "
                                 "expects sigmoid scores + a selection bias, then top-k; getitem after sigmoid breaks it"),
    ("ernie4_5_moe", "add", "router-like top-k over linear → softmax → add → topk: softmax_topk_router expects "
                            "top-k right after softmax; add after softmax breaks it"),
])
def test_unmatched_router_is_reported(family, op, reason):
    model, inputs = F.build(family)
    explanation = moe_fuse.explain(model, **inputs)
    lines = [x for x in explanation.rejected if x["pattern"] == "unmatched_router"]
    assert len(lines) == 2, explanation.rejected
    assert all(x["reason"].startswith(reason) for x in lines), lines
    assert all(x["where"].startswith(op) for x in lines)
    assert "unfused  unmatched_router" in str(explanation)


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
