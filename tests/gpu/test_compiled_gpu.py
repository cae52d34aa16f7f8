"""transformers' Qwen3-MoE block compiled by backend="moe_fuse" on the GPU: its output and gradients against the
block in float64, the same bits under the settings that must not change them, and which blocks are fused per
dtype."""

import copy

import pytest
import torch

from gpu_cases import needs_sm90, qwen3_block, rel_err

import moe_fuse
from moe_fuse import config
from moe_fuse.debug import collect_reports

pytestmark = pytest.mark.gpu


def grads(fn, params, x, dy):
    """[y, dx, then the gradient of each of params] of one forward + backward."""
    x = x.detach().requires_grad_()
    for p in params:
        p.grad = None
    y = fn(x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in params]


class SameRouting(torch.nn.Module):
    """The bf16 router, its outputs in float64: the reference picks the experts the bf16 block picks."""

    def __init__(self, router):
        super().__init__()
        self.inner = router

    def forward(self, h):
        return tuple(t.double() if t.is_floating_point() else t for t in self.inner(h.bfloat16()))


def test_block_against_float64():
    needs_sm90()
    block, x, dy = qwen3_block()
    params = list(block.parameters())
    ref = copy.deepcopy(block).double()
    ref.experts.config._experts_implementation = "eager"
    ref.gate = SameRouting(block.gate)  # the router's gradient comes through the bf16 router
    ref_params = dict(ref.named_parameters())
    want = grads(ref, [ref_params[n.replace("gate.", "gate.inner.")] for n, _ in block.named_parameters()],
                 x.double(), dy.double())
    eager = grads(block, params, x, dy)
    torch._dynamo.reset()
    with collect_reports() as reports:
        fused = grads(torch.compile(block, backend="moe_fuse"), params, x, dy)
    assert sorted(m["pattern"] for g in reports for m in g.matches) == ["grouped_mm_experts", "softmax_topk_router"]
    for i, (f, e, w) in enumerate(zip(fused, eager, want)):
        assert bool(torch.isfinite(f).all())
        assert rel_err(f, w) <= 2 * rel_err(e, w) + 1e-3, (i, rel_err(f, w), rel_err(e, w))


@pytest.mark.parametrize("base, other", [
    ({}, {"direct_launch": False}),                          # Triton's own launcher
    ({"ragged_min_rows": 0}, {"ragged_gemm": False}),        # ragged GEMM vs torch._grouped_mm
    ({}, {"split_backward": False}),                         # the backward as one op
    ({"grouped_mm": False}, {"grouped_mm": False, "overlap_wgrad": False}),  # weight gradients on one stream
])
def test_settings_keep_the_bits(base, other):
    needs_sm90()
    block, x, dy = qwen3_block()
    runs = []
    for settings in (base, other):
        torch._dynamo.reset()
        with config.patch(settings):
            fn = torch.compile(block, backend="moe_fuse")
            grads(fn, list(block.parameters()), x, dy)  # compile
            runs.append(grads(fn, list(block.parameters()), x, dy))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_grouped_mm_only_blocks_fused_in_bf16_only():
    """GPT-OSS (biases, interleaved rows) and Nemotron-H (no gate) run on the grouped_mm path alone: fused in bf16,
    left alone with the reason in fp32."""
    needs_sm90()
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    configs = {"gpt_oss": (GptOssMLP, transformers.GptOssConfig(
        hidden_size=512, intermediate_size=512, num_local_experts=16, num_experts_per_tok=4))}
    try:
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

        configs["nemotron_h"] = (lambda cfg: NemotronHMoE(cfg, layer_idx=0), transformers.NemotronHConfig(
            hidden_size=512, moe_intermediate_size=256, n_routed_experts=16, num_experts_per_tok=4,
            moe_shared_expert_intermediate_size=512, n_group=1, topk_group=1, mlp_hidden_act="relu2"))
    except ImportError:
        pass
    for name, (build, cfg) in configs.items():
        cfg._experts_implementation = "grouped_mm"
        for dtype in (torch.bfloat16, torch.float32):
            with torch.device("cuda"):
                block = build(cfg).to(dtype)
                with torch.no_grad():
                    for p in block.parameters():
                        p.normal_(0.0, 0.02)
                x = torch.randn(1, 256, 512, dtype=dtype, requires_grad=True)
            report = moe_fuse.explain(block, x)
            fused = [m for m in report.matches if m["pattern"] == "grouped_mm_experts"]
            assert bool(fused) == (dtype == torch.bfloat16), (name, dtype, str(report))
            if dtype == torch.float32:
                assert any(r["pattern"] == "grouped_mm_experts" and r["reason"] for r in report.rejected), str(report)
