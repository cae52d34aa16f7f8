"""Every transformers MoE model family, built tiny: backend="moe_fuse" gives eager's loss, output and
every gradient (fp32), whatever it fuses or leaves alone.

One test per family (tests/support/families.py builds them). A family is wrong when any compared value
differs by a relative norm of 1e-4 or more, and crashed when the compiled step raises: both fail here.
What was fused and why the rest was not is in the reports: `python tests/support/families_table.py`.
"""

import glob
import os

import pytest
import torch

from support import families as F


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_every_moe_family_is_swept():
    import transformers

    models = os.path.join(os.path.dirname(transformers.__file__), "models")
    using_interface = set()
    for path in glob.glob(os.path.join(models, "*", "modeling_*.py")):
        with open(path) as f:
            if "@use_experts_implementation" in f.read():
                using_interface.add(os.path.basename(os.path.dirname(path)))
    swept = set(F.FAMILIES) | set(F.UNBUILDABLE)
    assert using_interface - swept == set(), "families using the experts interface that the sweep misses"
    assert {f.name for f in F.INTERFACE_FAMILIES} == using_interface
    assert set(F.AOT_EAGER_BROKEN) <= set(F.FAMILIES)


@pytest.mark.parametrize("name", sorted(F.FAMILIES))
def test_family(name, tmp_path):
    from moe_fuse import config

    # Fewer tokens than a step's 24: every experts block whose sizes allow it is verified on 7 of them, as a GPU
    # step's on verify_tokens of its thousands.
    with config.patch(verify_tokens=7):
        result = F.run_family(name, tmp_path)
    wrong = {what: f"{err:.3g}" for what, err in result.errors.items() if not err < F.TOLERANCE}
    assert not wrong, f"{name} under moe_fuse differs from eager (relative norm >= {F.TOLERANCE}): {wrong}"
    assert result.reports, "moe_fuse compiled no graph"
    assert all(m["verified"] for m in result.matches)
    if result.experts_implementation in ("grouped_mm", "batched_mm"):
        # Every experts module of the standard layout runs fused; the others are left alone.
        standard = result.experts_modules - len(result.layout_reasons)
        assert result.fused_experts_calls == standard, (
            f"{result.fused_experts_calls} experts blocks ran fused, {standard} have the standard layout; "
            f"rejected: {result.rejected}")


@pytest.mark.parametrize("name", sorted(F.AOT_EAGER_BROKEN))
def test_plain_aot_eager_is_still_broken(name):
    """Why these families run moe_fuse with inner="eager": plain aot_eager fails without us."""
    model, inputs = F.build(name, num_hidden_layers=1, layer_types=None, mlp_layer_types=None)  # one layer shows it
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        F.loss_and_grads(compiled, inputs)


def test_what_is_left_alone_says_why(tmp_path):
    """MuseSpark: a norm between each expert's down projection and its routing weight, and router logits scaled
    before the sigmoid. Neither is fused; each rejection names the reason; eager's results."""
    result = F.run_family("muse_spark", tmp_path)
    assert not [m for m in result.matches if m["pattern"] in ("grouped_mm_experts", "sigmoid_topk_router")]
    reasons = {r["pattern"]: r["reason"] for r in result.rejected}
    assert reasons["grouped_mm_experts"].endswith(
        "normalized before the routing weights (a norm after each expert, transformers' has_post_expert_norm): "
        "not fused"), reasons
    assert reasons["sigmoid_topk_router"].startswith("the router's logits are scaled (mul by 0.17677"), reasons
    assert all(err < F.TOLERANCE for err in result.errors.values()), result.worst
