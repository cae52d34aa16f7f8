"""Router-like top-ks that no router pattern takes: one report line each, naming where the closest pattern
breaks."""

import pytest
import torch

from support import families as F
import moe_fuse


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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
