"""backend="moe_fuse" on unmodified tiny Qwen3-MoE models: same loss, logits and gradients
as eager, every MoE block rewritten, and the dumps say so."""

import json
import re
from pathlib import Path

import pytest
import torch

from support.models import loss_and_grads, qwen3_moe, rel_err, token_batch

# Relative-norm tolerances against eager: fp32 is rounding noise only; bf16
# eager itself rounds every intermediate, our fused path accumulates in fp32.
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def reports(debug_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(debug_dir.glob("graph_*/report.json"))]


def saved_h_flags(debug_dir: Path) -> list[str]:
    """The save_h argument of every moe_fuse.experts call in the rewritten graphs."""
    text = "".join(p.read_text() for p in sorted(debug_dir.glob("graph_*/after.py")))
    return re.findall(r"torch\.ops\.moe_fuse\.experts\.default\([^;]*, (True|False)\)", text)


def assert_parity(eager, fused, dtype):
    tol = TOL[dtype]
    loss, logits, aux, grads = eager
    loss2, logits2, aux2, grads2 = fused
    assert rel_err(loss2, loss) < tol
    assert rel_err(logits2, logits) < tol
    if aux is not None:
        assert rel_err(aux2, aux) < tol
    assert grads.keys() == grads2.keys()
    for name in grads:
        assert rel_err(grads2[name], grads[name]) < tol, name


def compile_moe_fuse(model, debug_dir, inner="aot_eager", **kwargs):
    options = {"moe_fuse.inner": inner, "moe_fuse.debug_dir": str(debug_dir)}
    return torch.compile(model, backend="moe_fuse", options=options, **kwargs)


def assert_all_blocks_fused(report, layers=2, where=""):
    moe = [m for m in report["matches"] if m["pattern"] != "causal_sdpa_mask"]  # attention: test_causal_mask.py
    patterns = sorted(m["pattern"] for m in moe)
    assert patterns == ["grouped_mm_experts"] * layers + ["softmax_topk_router"] * layers
    assert all(m["verified"] for m in moe)
    assert all(where in m["where"] for m in moe)
    assert report["rejected"] == []


SPELLINGS = {
    # fp32: transformers calls its torch.ops.transformers.grouped_mm_fallback under compile.
    "fp32_fallback_op": (torch.float32, False),
    "fp32_fallback_op_ep_sentinels": (torch.float32, True),
    # bf16: torch._grouped_mm.
    "bf16_grouped_mm": (torch.bfloat16, False),
    # transformers 5.17's spelling (EP sentinel ops always present).
    "bf16_grouped_mm_ep_sentinels": (torch.bfloat16, True),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_parity_and_rewrite(spelling, tmp_path):
    dtype, sentinels = SPELLINGS[spelling]
    model = qwen3_moe(dtype, expert_parallel_sentinels=sentinels)
    ids = token_batch()
    eager = loss_and_grads(model, ids)
    fused = loss_and_grads(compile_moe_fuse(model, tmp_path), ids)
    assert_parity(eager, fused, dtype)

    (report,) = [r for r in reports(tmp_path) if r["matches"]]
    assert_all_blocks_fused(report)
    m = next(m for m in report["matches"] if m["pattern"] == "grouped_mm_experts")
    assert (m["num_experts"], m["top_k"], m["hidden"], m["intermediate"]) == (6, 2, 32, 16)
    assert m["dtype"] == str(dtype).removeprefix("torch.")
    assert m["expert_parallel_sentinels"] is sentinels

    folder = tmp_path / report["graph"]
    after = (folder / "after.py").read_text()
    before = (folder / "before.py").read_text()
    assert after.count("torch.ops.moe_fuse.experts.default") == 2
    assert saved_h_flags(tmp_path) == ["True", "True"]  # traced for training: the forward keeps h
    assert after.count("torch.ops.moe_fuse.router.default") == 2
    assert "grouped_mm" in before and "grouped_mm" not in after
    assert "torch.sort" not in after and "torch.topk" in after  # the aux loss keeps its own top-k
    assert "fused" in (folder / "summary.txt").read_text()


def test_parity_through_inductor(tmp_path):
    model = qwen3_moe(torch.float32, num_hidden_layers=1)
    ids = token_batch()
    eager = loss_and_grads(model, ids)
    fused = loss_and_grads(compile_moe_fuse(model, tmp_path, inner="inductor"), ids)
    assert_parity(eager, fused, torch.float32)
    (report,) = [r for r in reports(tmp_path) if r["matches"]]
    assert_all_blocks_fused(report, layers=1)


def test_dynamic_token_count(tmp_path):
    model = qwen3_moe(torch.float32)
    compiled = compile_moe_fuse(model, tmp_path, dynamic=True)
    for seq in (12, 7):
        ids = token_batch(seq=seq)
        assert_parity(loss_and_grads(model, ids), loss_and_grads(compiled, ids), torch.float32)
    moe_reports = [r for r in reports(tmp_path) if r["matches"]]
    # One symbolic graph serves both lengths (Dynamo may trace it twice while it
    # settles which floats to specialise, within the same compile id).
    assert len({r["compile_id"] for r in moe_reports}) == 1
    for report in moe_reports:
        assert_all_blocks_fused(report)


def test_automatic_dynamic_recompile(tmp_path):
    model = qwen3_moe(torch.float32)
    compiled = compile_moe_fuse(model, tmp_path)
    for seq in (12, 9, 5):
        ids = token_batch(seq=seq)
        assert_parity(loss_and_grads(model, ids), loss_and_grads(compiled, ids), torch.float32)
    moe_reports = [r for r in reports(tmp_path) if r["matches"]]
    assert len(moe_reports) == 2  # static first, then one dynamic recompile
    for report in moe_reports:
        assert_all_blocks_fused(report)


def test_gradient_checkpointing_bodies(tmp_path):
    # output_router_logits=True collects logits through a hook that Dynamo refuses
    # inside a checkpoint (a side effect): then no graph holds the MoE at all.
    model = qwen3_moe(torch.float32, output_router_logits=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = token_batch()
    eager = loss_and_grads(model, ids, use_cache=False)
    fused = loss_and_grads(compile_moe_fuse(model, tmp_path), ids, use_cache=False)
    assert_parity(eager, fused, torch.float32)
    (report,) = [r for r in reports(tmp_path) if r["matches"]]
    assert_all_blocks_fused(report, where="wrap_body")
    # use_cache=False: transformers materialises the causal mask outside the bodies; it is followed in.
    assert sum(m["pattern"] == "causal_sdpa_mask" and "wrap_body" in m["where"] for m in report["matches"]) == 2
    # Inside a checkpointed body the backward recomputes h instead of the forward saving it.
    assert saved_h_flags(tmp_path) == ["False", "False"]


def test_inference_does_not_keep_h(tmp_path):
    """Under no_grad there is no backward: the fused op must not keep the [T*k, 2I] pre-activation."""
    model = qwen3_moe(torch.float32, num_hidden_layers=1)
    ids = token_batch()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = compile_moe_fuse(model, tmp_path)(input_ids=ids).logits
    assert rel_err(got, want) < TOL[torch.float32]
    assert saved_h_flags(tmp_path) == ["False"]


def checkpointed_step_with_router_logits(tmp_path):
    """(eager, fused): a training step with output_router_logits=True under gradient checkpointing."""
    model = qwen3_moe(torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = token_batch()
    eager = loss_and_grads(model, ids, use_cache=False)
    return eager, loss_and_grads(compile_moe_fuse(model, tmp_path), ids, use_cache=False)


def test_gradient_checkpointing_with_router_logits_says_why(tmp_path, monkeypatch):
    """The router-logits hook appends to a list outside the checkpoint: Dynamo runs the checkpointed layers
    eagerly, so no graph holds a MoE block. The report says so and how to have them fused, and so does a warning;
    the step is eager's."""
    from moe_fuse import debug

    monkeypatch.setattr(debug, "_warned", set())
    with pytest.warns(UserWarning, match=r"skip_fwd_side_effects_in_bwd_under_checkpoint = True") as caught:
        eager, fused = checkpointed_step_with_router_logits(tmp_path)
    assert sum("moe_fuse: Dynamo ran a region eagerly" in str(w.message) for w in caught) == 1
    assert_parity(eager, fused, torch.float32)
    every = reports(tmp_path)
    assert [m for r in every for m in r["matches"]] == []
    assert [x for r in every for x in r["rejected"]] == [
        {"pattern": "eager_checkpoint", "reason": debug.EAGER_CHECKPOINT_REASON, "where": "(no graph)", "notes": []}]
    assert "transformers' output_router_logits=True does this under gradient checkpointing" in debug.EAGER_CHECKPOINT_REASON
    summary = (tmp_path / "summary.txt").read_text()
    assert "unfused  eager_checkpoint       at (no graph): Dynamo ran a region eagerly, without a graph" in summary


def test_gradient_checkpointing_with_router_logits_fused_under_dynamos_switch(tmp_path):
    """What the report advises: with Dynamo's skip_fwd_side_effects_in_bwd_under_checkpoint the checkpointed
    layers are graphs and fused, with eager's loss, aux loss and gradients (transformers' hook records nothing in
    the backward's recomputation in eager either)."""
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        eager, fused = checkpointed_step_with_router_logits(tmp_path)
    assert eager[2] is not None
    assert_parity(eager, fused, torch.float32)
    (report,) = [r for r in reports(tmp_path) if r["matches"]]
    assert_all_blocks_fused(report, where="wrap_body")
    assert all(r["rejected"] == [] for r in reports(tmp_path))
    assert saved_h_flags(tmp_path) == ["False", "False"]
