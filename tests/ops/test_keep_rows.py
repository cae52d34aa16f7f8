"""What the experts op's training forward keeps for the backward on the grouped_mm path: h, the routing, the
expert-sorted rows of x (``moe_fuse.keep_rows``, on by default) and the weighted activation only with
``config.keep_activation`` (off by default: the backward's dSwiGLU pass writes it again). ``moe_fuse.keep_rows=False``
keeps neither rows nor activation; the backward gathers x again. The gradients are the same bits either way."""

import os
import re

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch.library import opcheck  # noqa: E402

from support import families  # noqa: E402
from support.cases import DEVICE, make_case  # noqa: E402
from support.steps import assert_same_step, compare  # noqa: E402

from moe_fuse import config, dispatch  # noqa: E402
from moe_fuse import kernels, ops  # noqa: E402
from moe_fuse.backend import parse_options  # noqa: E402
from moe_fuse.kernels import grouped_mm_path  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def test_option_is_checked():
    assert parse_options(None)[0]["keep_rows"] is True
    assert parse_options({"moe_fuse.keep_rows": False})[0]["keep_rows"] is False
    with pytest.raises(ValueError, match="moe_fuse.keep_rows='no'; expected True or False"):
        parse_options({"moe_fuse.keep_rows": "no"})


def _experts_calls(tmp_path):
    after = "".join(p.read_text() for p in sorted(tmp_path.glob("graph_*/after.py")))
    return re.findall(r"torch\.ops\.moe_fuse\.experts\.default\(([^;]*)\)", after)


@pytest.mark.parametrize("keep_rows", [True, False])
def test_rewritten_calls_and_the_step(keep_rows, tmp_path):
    """Every training call of the experts op gets keep_rows=False from the option (and only then); the step stays
    eager's."""
    model, inputs = families.build("qwen3_moe")
    eager, fused, _ = compare(model, inputs, tmp_path, {"moe_fuse.keep_rows": keep_rows})
    calls = _experts_calls(tmp_path)
    assert len(calls) == 2, calls
    for call in calls:
        assert call.endswith("True, keep_rows = False") if not keep_rows else "keep_rows" not in call, call
    assert_same_step(eager, fused, output=True)


def test_inference_calls_are_left_as_they_are(tmp_path):
    """Without gradients the op keeps nothing anyway: the option does not touch those calls."""
    model, inputs = families.build("qwen3_moe")
    model.eval()
    torch._dynamo.reset()
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": str(tmp_path), "moe_fuse.keep_rows": False}
    try:
        with torch.no_grad():
            want = model(**inputs).logits
            got = torch.compile(model, backend="moe_fuse", options=options)(**inputs).logits
    finally:
        torch._dynamo.reset()
    calls = _experts_calls(tmp_path)
    assert len(calls) == 2 and all(c.endswith("False") for c in calls), calls
    assert families.rel_err(got, want) < families.TOLERANCE


def test_op_keeps_neither_rows_nor_activation(on_grouped_mm_path):
    T, k, E, H, I = 24, 2, 4, 32, 16
    args = make_case(T, k, E, H, I, torch.float32, "skewed", seed=3)
    with config.patch(keep_activation=True):
        kept = torch.ops.moe_fuse.experts(*args, True)
        lean = torch.ops.moe_fuse.experts(*args, True, keep_rows=False)
    assert kept[2].shape == (T * k, H) and kept[4].shape == (T * k, I)  # xs, aw
    assert lean[2].shape == (0, H) and lean[4].shape == (0, I)
    for a, b in zip((kept[0], kept[1], kept[3]), (lean[0], lean[1], lean[3])):  # y, h, routing
        assert torch.equal(a, b)
    # what the op's backward then computes: the kernels with xs and aw to recompute, the same bits
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    routing = kernels.routing_from_buffer(kept[3], T * k, E)
    with_rows = dispatch.experts_backward(dy, *args, kept[1], routing=routing, xs=kept[2], aw=kept[4])
    without = dispatch.experts_backward(dy, *args, lean[1], routing=routing)
    for a, b in zip(with_rows, without):
        assert torch.equal(a, b)


@pytest.mark.parametrize("settings,kept", [({}, "xs"), ({"keep_activation": True}, "xs,aw"), ({"keep_rows": False}, ""),
                                            ({"keep_rows": False, "keep_activation": True}, "")])
def test_what_the_training_forward_keeps(settings, kept, on_grouped_mm_path):
    """On the grouped_mm path the forward that keeps h also keeps the sorted rows xs [S, H] (keep_rows, on by
    default) and the weighted activation aw [S, I] only with keep_activation; the fake implementation agrees, and
    the op's schema and fake pass opcheck either way."""
    T, k, E, H, I = 12, 2, 4, 16, 8
    S = T * k
    args = make_case(T, k, E, H, I, torch.float32, seed=17)
    keep_rows = settings.get("keep_rows", True)
    with config.patch(keep_activation=settings.get("keep_activation", False)):
        y, h, xs, routing, aw = torch.ops.moe_fuse.experts(*args, True, keep_rows=keep_rows)
        with torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = torch.ops.moe_fuse.experts(*(mode.from_tensor(t) for t in args), True, keep_rows=keep_rows)
        opcheck(torch.ops.moe_fuse.experts.default, (*args, True), {"keep_rows": keep_rows},
                test_utils=("test_schema", "test_faketensor"))
    assert h.shape == (S, 2 * I) and routing.numel() > 0
    assert xs.shape == ((S, H) if "xs" in kept else (0, H))
    assert aw.shape == ((S, I) if "aw" in kept else (0, I))
    assert [tuple(f.shape) for f in fake] == [tuple(t.shape) for t in (y, h, xs, routing, aw)]
    if "aw" in kept:  # the routing weight times SwiGLU(h), in expert order
        w = args[2].reshape(-1)[kernels.routing_from_buffer(routing, S, E).order.long()]
        torch.testing.assert_close(aw, torch.nn.functional.silu(h[:, :I]) * h[:, I:] * w[:, None])


def test_opcheck_without_rows(on_grouped_mm_path):
    """The fake implementation predicts the empty xs and aw (and the autograd formula takes the extra argument)."""
    x, ids, weights, w_gate_up, w_down = make_case(12, 2, 4, 16, 8, torch.float32, seed=5)
    req = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    opcheck(torch.ops.moe_fuse.experts.default, (req(x), ids, req(weights), req(w_gate_up), req(w_down), True),
            {"keep_rows": False}, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
