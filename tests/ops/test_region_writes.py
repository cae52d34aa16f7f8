"""In-place writes and the block's region (pipeline/graph.collect_region).

A write placed before the block's outputs is part of what the block computes (``inv[perm] = arange``);
one placed after them is not. transformers' all-reduce expert parallelism at inference writes the
all-reduced sum into the experts' output (``dist.all_reduce(out)``: a ``copy_`` after the block). Such a
write stays in the graph, now into the fused op's output; a later write into any other tensor of the
block, or into an output that shares memory with a tensor read elsewhere, refuses the match.
"""

import pytest
import torch
import torch.fx as fx

from support.models import loss_and_grads, qwen3_moe, rel_err, token_batch
from moe_fuse.pipeline.graph import NoMatch, collect_region


def _nodes(gm: fx.GraphModule) -> dict:
    return {n.name: n for n in gm.graph.nodes}


def _region_names(fn, inputs, outputs):
    gm = fx.symbolic_trace(fn)
    n = _nodes(gm)
    region = collect_region([n[i] for i in inputs], [n[o] for o in outputs])
    return [node.name for node in region.nodes]


def test_write_before_the_outputs_is_part_of_the_block():
    def f(a):
        mid = a * 2
        mid.add_(1)
        return mid + 1

    assert _region_names(f, ["a"], ["add"]) == ["mul", "add_", "add"]


def test_write_into_an_output_after_the_block_stays_outside():
    def f(a):
        out = a * 2 + 1
        out.mul_(3)
        return out

    assert _region_names(f, ["a"], ["add"]) == ["mul", "add"]


def test_write_into_an_inner_tensor_after_the_block_refuses():
    def f(a):
        mid = a * 2
        out = mid + 1
        mid.add_(1)
        return out, mid

    with pytest.raises(NoMatch, match="add_ writes into mul, a tensor of the block, after the block"):
        _region_names(f, ["a"], ["add"])


def test_write_into_an_output_aliasing_a_tensor_read_elsewhere_refuses():
    def f(a):
        mid = a * 2
        out = mid.view(-1)
        other = mid.sum()
        out.mul_(3)
        return out, other

    with pytest.raises(NoMatch, match="may share memory with mul, read outside the block"):
        _region_names(f, ["a"], ["view"])


def _write_into_experts_output(model, factor: float):
    """Each experts module scales its own output in place, as ``dist.all_reduce(out)`` writes into it."""
    for layer in model.model.layers:
        experts = layer.mlp.experts

        def forward(hidden, ids, weights, inner=experts.forward):
            out = inner(hidden, ids, weights)
            out.mul_(factor)
            return out

        experts.forward = forward
    return model


@pytest.mark.parametrize("verify", [True, False])
def test_experts_output_written_after_the_block(verify, tmp_path):
    torch._dynamo.reset()
    ids = token_batch()
    eager = loss_and_grads(_write_into_experts_output(qwen3_moe(), 2.0), ids)
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": str(tmp_path), "moe_fuse.verify": verify}
    model = torch.compile(_write_into_experts_output(qwen3_moe(), 2.0), backend="moe_fuse", options=options)
    fused = loss_and_grads(model, ids)
    for want, got in zip(eager[:3], fused[:3]):
        assert rel_err(got, want) < 1e-5
    for name, grad in eager[3].items():
        assert rel_err(fused[3][name], grad) < 1e-5, name
    after = "".join(p.read_text() for p in tmp_path.glob("graph_*/after.py"))
    assert after.count("torch.ops.moe_fuse.experts.default(") == 2
    # The scaling survives, applied to the fused op's output.
    assert after.count("mul_(2.0)") == 2
    torch._dynamo.reset()


def test_collective_inside_the_block_refuses():
    """Verification runs the block on probes, so a block may not hold a collective (the other ranks would
    not take part); an all-reduce after the block is a plain user of its output."""
    graph = fx.Graph()
    a = graph.placeholder("a")
    mid = graph.call_function(torch.mul, (a, 2))
    reduced = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (mid, "sum", "0"))
    waited = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,))
    out = graph.call_function(torch.add, (waited, 1))
    graph.output(out)
    with pytest.raises(NoMatch, match="wait_tensor_default is a collective inside the block"):
        collect_region([a], [out])
    assert [n.name for n in collect_region([a], [mid]).nodes] == ["mul"]
