"""transformers' `eager` experts loop cannot be captured whole: recognised, explained, results unchanged."""

import warnings

import torch

import moe_fuse
import moe_fuse.debug
from support.models import loss_and_grads, qwen3_moe, rel_err, token_batch


def test_eager_loop_is_explained_and_left_alone(tmp_path):
    torch._dynamo.reset()
    model = qwen3_moe(torch.float32)
    model.set_experts_implementation("eager")
    ids = token_batch()
    eager = loss_and_grads(model, ids)
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": str(tmp_path)}
    moe_fuse.debug._warned.clear()  # the warning is once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = loss_and_grads(torch.compile(model, backend="moe_fuse", options=options), ids)
    for a, b in zip(eager[:3], fused[:3]):
        assert rel_err(b, a) < 1e-5
    for name in eager[3]:
        assert rel_err(fused[3][name], eager[3][name]) < 1e-5

    summary = (tmp_path / "summary.txt").read_text()
    assert "unfused  eager_experts_loop" in summary and "grouped_mm" in summary
    mine = [w for w in caught if "moe_fuse" in str(w.message)]
    assert len(mine) == 1  # said once, not per graph or layer
    assert "config._experts_implementation = 'grouped_mm'" in str(mine[0].message)
    explanation = moe_fuse.explain(model, input_ids=ids)
    assert explanation.matches == [] or all(m["pattern"] == "softmax_topk_router" for m in explanation.matches)
    assert any(r["pattern"] == "eager_experts_loop" for r in explanation.rejected)
    torch._dynamo.reset()


def test_own_loop_family_has_nothing_to_switch(tmp_path):
    """dbrx loops over experts in its own modeling code: the advice is not 'use grouped_mm'."""
    from support import families

    torch._dynamo.reset()
    model, inputs = families.build("dbrx", num_hidden_layers=1)
    eager = families.loss_and_grads(model, inputs)
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": str(tmp_path)}
    moe_fuse.debug._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = families.loss_and_grads(torch.compile(model, backend="moe_fuse", options=options), inputs)
    torch._dynamo.reset()
    assert rel_err(fused[0], eager[0]) < 1e-5
    for name in eager[3]:
        assert rel_err(fused[3][name], eager[3][name]) < 1e-5, name

    summary = (tmp_path / "summary.txt").read_text()
    assert "unfused  eager_experts_loop" in summary
    assert "DbrxExperts runs its experts as a Python loop in its own modeling code" in summary
    assert "transformers/models/dbrx/modeling_dbrx.py" in summary
    assert "There is no experts implementation to switch" in summary
    assert "_experts_implementation" not in summary and "'grouped_mm'" not in summary
    mine = [str(w.message) for w in caught if "moe_fuse" in str(w.message)]
    assert len(mine) == 1 and "no experts implementation to switch" in mine[0]


def test_advice_follows_the_module_that_loops():
    from moe_fuse.patterns.eager_loop import uses_experts_interface
    from transformers.models.dbrx.modeling_dbrx import DbrxExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    assert uses_experts_interface(Qwen3MoeExperts)
    assert not uses_experts_interface(DbrxExperts)
