"""Decode-sized inference steps on a GPU are left to Inductor unless they run under CUDA graphs
(dispatch.host_bound_step, config.small_step_tokens): the rule, and the pipeline rejecting both the experts and
the router of such a step with the reason, results unchanged."""

import pytest
import torch

from moe_fuse import config, dispatch
from moe_fuse.debug import collect_reports
from support.models import qwen3_moe, token_batch

CUDA = torch.device("cuda")


def test_the_rule():
    assert "an inference step of 64 tokens is bound by the host's time" in dispatch.host_bound_step(64, CUDA, False)
    assert dispatch.host_bound_step(1, CUDA, False).endswith("moe_fuse.mode='reduce-overhead' runs them fused, "
                                                             "under CUDA graphs)")
    assert dispatch.host_bound_step(65, CUDA, False) is None  # past the threshold
    assert dispatch.host_bound_step(8, CUDA, True) is None  # training: the backward is the step's bulk
    assert dispatch.host_bound_step(8, torch.device("cpu"), False) is None
    for mode in ("reduce-overhead", "max-autotune"):  # CUDA graphs take the host out
        with config.patch(mode=mode):
            assert dispatch.host_bound_step(8, CUDA, False) is None
    with config.patch(small_step_tokens=0):
        assert dispatch.host_bound_step(1, CUDA, False) is None
    with config.patch(small_step_tokens=256):
        assert dispatch.host_bound_step(256, CUDA, False) is not None


@pytest.mark.parametrize("grad", [False, True])
def test_pipeline_leaves_small_inference_steps(monkeypatch, grad):
    """The device rule answered as on a GPU: an inference step of 24 tokens keeps its graph (experts and router
    rejected with the reason); the same step with gradients is fused."""
    real = dispatch.host_bound_step
    monkeypatch.setattr(dispatch, "host_bound_step", lambda tokens, device, g: real(tokens, CUDA, g))
    model = qwen3_moe(attn_implementation="sdpa", num_hidden_layers=1, output_router_logits=False)
    ids = token_batch(batch=2, seq=12)
    with torch.set_grad_enabled(grad):
        want = model(input_ids=ids).logits
        with collect_reports() as reports:
            got = torch.compile(model, backend="moe_fuse", options={"moe_fuse.inner": "aot_eager"})(input_ids=ids).logits
    torch.testing.assert_close(got, want)
    matched = sorted(m["pattern"] for r in reports for m in r.matches)
    rejected = sorted((x["pattern"], x["reason"]) for r in reports for x in r.rejected
                      if "bound by the host" in x["reason"])
    if grad:
        assert matched == ["grouped_mm_experts", "softmax_topk_router"] and rejected == []
    else:
        assert "grouped_mm_experts" not in matched and "softmax_topk_router" not in matched
        assert [p for p, _ in rejected] == ["grouped_mm_experts", "softmax_topk_router"]
        assert all(reason.startswith("an inference step of 24 tokens") for _, reason in rejected)
