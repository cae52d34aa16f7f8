"""moe_fuse as a transformers experts implementation: `model.set_experts_implementation("moe_fuse")`
in eager mode, no torch.compile."""

import subprocess
import sys
import warnings

import pytest
import torch

import moe_fuse
from support.models import loss_and_grads, qwen3_moe, rel_err, token_batch


@pytest.fixture(autouse=True)
def registered():
    from moe_fuse.integrations import transformers as integration

    assert moe_fuse.register_experts_implementation() == "moe_fuse"
    integration._warned.clear()  # the fallback warning is once per process
    yield


def count_experts_calls(model, ids):
    """How many torch.ops.moe_fuse.experts calls one forward makes."""
    from torch.overrides import TorchFunctionMode

    calls = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.moe_fuse.experts.default or func is torch.ops.moe_fuse.experts:
                calls.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        model(input_ids=ids)
    return len(calls)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_parity_with_grouped_mm(dtype, tol):
    model = qwen3_moe(dtype)
    ids = token_batch()
    eager = loss_and_grads(model, ids)  # transformers' default, grouped_mm
    model.set_experts_implementation("moe_fuse")
    assert model.config._experts_implementation == "moe_fuse"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the standard layout never falls back
        fused = loss_and_grads(model, ids)
    for a, b in zip(eager[:3], fused[:3]):
        assert rel_err(b, a) < tol
    assert eager[3].keys() == fused[3].keys()
    for name in eager[3]:
        assert rel_err(fused[3][name], eager[3][name]) < tol, name


def test_the_fused_op_runs():
    model = qwen3_moe(torch.float32)
    model.set_experts_implementation("moe_fuse")
    assert count_experts_calls(model, token_batch()) == 2  # one per layer


def test_weights_stored_transposed():
    """Aria stores its expert weights [E, in, out] (``is_transposed``): one fused op per layer on transposed views,
    transformers' loss and gradients, and the parameters' gradients in their own (contiguous) layout."""
    from support import families as F

    model, inputs = F.build("aria")
    assert all(m.is_transposed for m in F.interface_experts(model))
    eager = loss_and_grads(model, inputs["input_ids"])
    model.set_experts_implementation("moe_fuse")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        fused = loss_and_grads(model, inputs["input_ids"])
    assert count_experts_calls(model, inputs["input_ids"]) == len(F.interface_experts(model))
    for a, b in zip(eager[:3], fused[:3]):
        assert b is None and a is None or rel_err(b, a) < 1e-5
    for name in eager[3]:
        assert rel_err(fused[3][name], eager[3][name]) < 1e-5, name
    experts = [n for n in fused[3] if n.endswith(("gate_up_proj", "down_proj"))]
    assert experts and all(fused[3][n].is_contiguous() for n in experts)


def test_unsupported_layout_falls_back_with_one_warning():
    model = qwen3_moe(torch.float32)
    ids = token_batch()
    for module in model.modules():
        if hasattr(module, "has_post_expert_norm"):
            module.act_fn = torch.nn.GELU()  # the fused op computes silu only
    want = loss_and_grads(model, ids)  # transformers' grouped_mm
    model.set_experts_implementation("moe_fuse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = loss_and_grads(model, ids)
        loss_and_grads(model, ids)
    mine = [w for w in caught if "moe_fuse experts implementation" in str(w.message)]
    assert len(mine) == 1  # once, not per layer or call
    message = str(mine[0].message)
    assert "Qwen3MoeExperts" in message and "activation GELU, not silu" in message and "grouped_mm" in message
    assert count_experts_calls(model, ids) == 0
    assert rel_err(got[0], want[0]) < 1e-6  # exactly transformers' grouped_mm path
    for name in want[3]:
        assert rel_err(got[3][name], want[3][name]) < 1e-6, name


def test_unsupported_reasons():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from support.models import qwen3_moe_config
    from moe_fuse.integrations.transformers import unsupported_reason

    assert unsupported_reason(Qwen3MoeExperts(qwen3_moe_config())) is None
    from transformers import GptOssConfig

    gpt_oss = GptOssExperts(GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4))
    assert unsupported_reason(gpt_oss) is None  # biases, interleaved rows, stored transposed: all taken
    plain = Qwen3MoeExperts(qwen3_moe_config())
    plain.has_bias = True
    assert unsupported_reason(plain) == "expert biases whose gate_up_proj_bias is missing, not a [6, 32] tensor"
    plain.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(6, 32))
    plain.down_proj_bias = torch.nn.Parameter(torch.zeros(6, 7))
    assert unsupported_reason(plain) == "expert biases whose down_proj_bias is of shape [6, 7], not a [6, 32] tensor"


def test_unknown_name_before_registration_is_transformers_error():
    model = qwen3_moe(torch.float32)
    with pytest.raises(ValueError, match="not supported"):
        model.set_experts_implementation("moe_fuse_not_registered")


def test_import_stays_light():
    # TORCH_LOGS=+moe_fuse imports moe_fuse while `import torch` runs: no torch at import time.
    code = "import sys, moe_fuse; assert 'torch' not in sys.modules; " \
           "assert callable(moe_fuse.register_experts_implementation)"
    subprocess.run([sys.executable, "-c", code], check=True)
