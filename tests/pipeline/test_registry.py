"""The pattern registry (moe_fuse/patterns/__init__.py): every pattern module is listed once, in rewrite order."""

import importlib
import pkgutil

import torch

from moe_fuse import patterns
from moe_fuse.pipeline.candidate import GraphRewrite, Pattern


def _modules():
    return {info.name: importlib.import_module(f"moe_fuse.patterns.{info.name}")
            for info in pkgutil.iter_modules(patterns.__path__)}


def test_every_pattern_module_is_registered_once():
    registered = [*patterns.FIRST, *patterns.PATTERNS, *patterns.LAST]
    declared = []
    for module in _modules().values():
        for attr, kind in (("PATTERN", Pattern), ("REWRITE", GraphRewrite)):
            entry = getattr(module, attr, None)
            if entry is not None:
                assert isinstance(entry, kind) and entry.name == module.NAME, module.__name__
                declared.append(entry)
    assert sorted(e.name for e in registered) == sorted(e.name for e in declared)
    assert len({e.name for e in registered}) == len(registered)
    assert all(isinstance(p, Pattern) for p in patterns.PATTERNS)
    assert all(isinstance(r, GraphRewrite) for r in (*patterns.FIRST, *patterns.LAST))


def test_rewrite_order():
    """The experts patterns before the routers (an experts op reads the router's outputs, which the router rewrite
    then redirects), the diagnostics last; the EP chain before every pattern, the attention mask after."""
    names = [p.name for p in patterns.PATTERNS]
    assert names == ["grouped_mm_experts", "batched_mm_experts", "dense_experts", "torchtitan_experts",
                     "softmax_topk_router", "sigmoid_topk_router", "topk_softmax_router",
                     "unmatched_router", "eager_experts_loop"]
    assert [r.name for r in patterns.FIRST] == ["torchtitan_ep_dispatch"]
    assert [r.name for r in patterns.LAST] == ["causal_sdpa_mask"]


def test_graph_rewrites_are_off_as_configured():
    """The EP chain rewrite is opt-in (config.ep_chunks), the mask rewrite follows config.causal_sdpa: neither
    reads the graph when off."""
    from moe_fuse import config

    class Unreadable:
        @property
        def graph(self):
            raise AssertionError("read while switched off")

    with config.patch(ep_chunks=None, causal_sdpa=False):
        for rewrite in (*patterns.FIRST, *patterns.LAST):
            assert rewrite.run(Unreadable(), None, "", None) is False


def test_recompute_h_turns_off_the_declared_save_h_only():
    """A candidate declares where its op's save_h is (``save_h_at``); inside checkpointed bodies the pipeline turns
    that one off. A candidate without one (a router) is left as it is."""
    from moe_fuse.pipeline.candidate import Candidate

    assert Candidate.__dataclass_fields__["save_h_at"].default is None
    op_args = (torch.empty(0), "ids", True, 7.0)
    cand = Candidate(pattern="p", spec=None, region=None, op=None, op_args=op_args, output_index=[None],
                     input_kinds=[], anchor=None, save_h_at=2)
    cand.recompute_h()
    assert cand.op_args[2] is False and cand.op_args[3] == 7.0
    routerlike = Candidate(pattern="p", spec=None, region=None, op=None, op_args=(True,), output_index=[0],
                           input_kinds=[], anchor=None)
    routerlike.recompute_h()
    assert routerlike.op_args == (True,)
