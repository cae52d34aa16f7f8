"""Fake values of new or changed nodes (moe_fuse/pipeline/fake.py)."""

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from moe_fuse.pipeline.fake import fake_mode_of, set_fake_value


def _graph_with_fakes():
    mode = FakeTensorMode()
    graph = fx.Graph()
    x = graph.placeholder("x")
    with mode:
        x.meta["example_value"] = torch.empty(4, 6)
    return mode, graph, x


def test_new_and_changed_nodes_get_their_fake_values_in_the_graph_mode():
    mode, graph, x = _graph_with_fakes()
    t = graph.call_method("transpose", (x, 0, 1))
    s = graph.call_function(torch.sum, (t,), {"dim": 0})
    assert tuple(set_fake_value(t).shape) == (6, 4)
    assert tuple(set_fake_value(s).shape) == (4,)
    assert s.meta["example_value"].fake_mode is mode
    s.update_kwarg("dim", 1)  # a changed node: its value follows the call as it now is
    assert tuple(set_fake_value(s).shape) == (6,)


def test_mode_from_a_tuple_value_and_no_mode_without_fakes():
    mode, graph, x = _graph_with_fakes()
    with mode:
        pair = (torch.empty(2), torch.empty(3))
    assert fake_mode_of([None, pair]) is mode
    assert fake_mode_of([None, (), 1.0]) is None
    plain = fx.Graph()
    y = plain.placeholder("y")
    neg = plain.call_function(torch.neg, (y,))
    assert set_fake_value(neg) is None and "example_value" not in neg.meta


def test_an_explicit_mode_serves_nodes_without_tensor_inputs():
    mode, graph, _ = _graph_with_fakes()
    ones = graph.call_function(torch.ones, (3, 2))
    value = set_fake_value(ones, mode)
    assert value.fake_mode is mode and tuple(value.shape) == (3, 2)
