"""A tiny model's training step eagerly and through moe_fuse, compared: ``compare`` (through backend="moe_fuse",
with the reports it wrote), ``run`` (a family built, then compared), ``assert_same_step``, ``experts_entries``
(the experts pattern's entries of the reports) and ``eager_interface_step`` (the step with the eager experts
implementation, and the Epilogue of every experts op call).
"""

import torch

from moe_fuse.spec import Epilogue

from . import families


def compare(model, inputs, tmp_path, options=None):
    """(eager, fused, reports): one training step eagerly and through backend="moe_fuse" (aot_eager inside, more
    ``options`` if given)."""
    import json

    eager = families.loss_and_grads(model, inputs)
    torch._dynamo.reset()
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": str(tmp_path), **(options or {})}
    try:
        fused = families.loss_and_grads(torch.compile(model, backend="moe_fuse", options=options), inputs)
    finally:
        torch._dynamo.reset()
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("graph_*/report.json"))]
    return eager, fused, reports


def run(name, tmp_path, **overrides):
    model, inputs = families.build(name, **overrides)
    return (model, *compare(model, inputs, tmp_path))


def assert_same_step(eager, fused, output=False):
    """Loss (and the output), and every parameter gradient, within the families' tolerance of eager's."""
    pairs = [("loss", fused[0], eager[0])] + ([("output", fused[1], eager[1])] if output else [])
    pairs += [(f"grad {n}", fused[3][n], g) for n, g in eager[3].items()]
    for what, a, b in pairs:
        assert families.rel_err(a, b) < families.TOLERANCE, what


def experts_entries(reports, key):
    return [e for r in reports for e in r[key] if e["pattern"] == "grouped_mm_experts"]


def eager_interface_step(model, inputs):
    """One training step with ``model.set_experts_implementation("moe_fuse")`` (no torch.compile), a fallback to
    transformers' forward being an error: (its loss and gradients, each experts op call's Epilogue).
    Shared by the gate tests."""
    import warnings

    import moe_fuse
    from torch.overrides import TorchFunctionMode

    moe_fuse.register_experts_implementation()
    model.set_experts_implementation("moe_fuse")
    gates = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.moe_fuse.experts.default, torch.ops.moe_fuse.experts):
                encoded = args[6] if len(args) > 6 else (kwargs or {}).get("epilogue", "silu")
                gates.append(Epilogue.decode(encoded))
            return func(*args, **(kwargs or {}))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a proven gate does not fall back
        with Spy():
            fused = families.loss_and_grads(model, inputs)
    return fused, gates
