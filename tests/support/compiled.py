"""Compiling through backend="moe_fuse" in tests, and reading what it did: the rewritten graph, the reports."""

from __future__ import annotations

import json
import re

import torch

from . import families


def rewritten_code(block, x, **options) -> str:
    """The code of ``block``'s graph after moe_fuse's rewrite (inner="eager", more ``options`` if given)."""
    from moe_fuse.backend import moe_fuse_backend

    captured = []

    def backend(gm, example_inputs):
        compiled = moe_fuse_backend(gm, example_inputs, options={"moe_fuse.inner": "eager", **options})
        captured.append(gm)  # rewritten in place
        return compiled

    torch._dynamo.reset()
    torch.compile(block, backend=backend)(x)
    (gm,) = captured
    return gm.code.strip()


def reports(debug_dir) -> list[dict]:
    """report.json of every graph dumped into ``debug_dir``, in graph order."""
    return [json.loads(p.read_text()) for p in sorted(debug_dir.glob("graph_*/report.json"))]


def matches(reports, pattern) -> list[dict]:
    return [m for r in reports for m in r["matches"] if m["pattern"] == pattern]


def rejected(reports, pattern=None) -> list[dict]:
    return [x for r in reports for x in r["rejected"] if pattern is None or x["pattern"] == pattern]


def compiled_step(model, inputs, tmp_path, **options):
    """(eager, fused, reports): one training step of a ``families`` model eagerly and through backend="moe_fuse"
    (aot_eager inside, dumps in ``tmp_path``, more ``options`` if given)."""
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": str(tmp_path), **options}
    eager = families.loss_and_grads(model, inputs)
    torch._dynamo.reset()
    try:
        fused = families.loss_and_grads(torch.compile(model, backend="moe_fuse", options=options), inputs)
    finally:
        torch._dynamo.reset()
    return eager, fused, reports(tmp_path)


def assert_parity(eager, fused, tol=1e-5, output=True):
    """The loss, the output (when ``output``) and every parameter gradient of the compiled step within ``tol``
    (relative norm) of eager's."""
    pairs = [("loss", eager[0], fused[0])] + ([("output", eager[1], fused[1])] if output else [])
    for what, a, b in pairs:
        assert families.rel_err(b, a) < tol, what
    assert eager[3].keys() == fused[3].keys()
    for name in eager[3]:
        assert families.rel_err(fused[3][name], eager[3][name]) < tol, name


def op_lines(code: str, op: str) -> list[str]:
    """The lines of ``code`` that call ``torch.ops.moe_fuse.<op>``, each up to its first ';', with the parameter
    names shortened to weight, bias, e_score_correction_bias."""
    lines = [line.strip().split(";")[0] for line in code.splitlines() if f"torch.ops.moe_fuse.{op}" in line]
    return [re.sub(r"l_self_modules_\w+?_(weight|bias|e_score_correction_bias)_\b", r"\1", line) for line in lines]
