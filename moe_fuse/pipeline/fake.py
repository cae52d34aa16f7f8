"""Fake values for nodes a rewrite adds or changes.

Dynamo records each node's output metadata as a fake tensor in ``node.meta["example_value"]``; the
patterns read shapes and dtypes from it, and so do later passes and Inductor. A node a rewrite
creates, or one whose arguments it changes, gets its value recomputed here: the node's target run
on its inputs' fake values, in the graph's own fake mode.
"""

from __future__ import annotations

import torch.fx as fx

from .graph import meta_value


def fake_mode_of(values):
    """The fake mode of the first fake tensor among ``values`` (a tuple or list counts by its first element),
    or None."""
    for value in values:
        if isinstance(value, (tuple, list)) and value:
            value = value[0]
        mode = getattr(value, "fake_mode", None)
        if mode is not None:
            return mode
    return None


def set_fake_value(node: fx.Node, mode=None):
    """Recompute ``node.meta["example_value"]`` from its inputs' fake values and return it.

    ``mode``: the fake mode to run in; by default the one of the node's inputs. Without one (no input has a
    fake value) the node is left as it is and None comes back."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), meta_value)
    if mode is None:
        mode = fake_mode_of(meta_value(n) for n in node.all_input_nodes)
    if mode is None:
        return None
    with mode:
        if node.op == "call_method":
            value = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            value = node.target(*args, **kwargs)
    node.meta["example_value"] = value
    return value
