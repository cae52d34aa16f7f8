"""Expert parallelism in compiled graphs, on CPU: 2 gloo processes.

- ``torch.ops.moe_fuse.ep_experts`` (moe_fuse/parallel/ep_ops.py), eager and under torch.compile, against
  the eager chunked path, uneven and empty splits included.
- The TorchTitan dispatch pass (moe_fuse/patterns/ep_torchtitan.py) on TorchTitan 0.3.0's own MoE with its
  AllToAllTokenDispatcher over a 2-rank mesh, captured in one graph (``capture_scalar_outputs``, as
  TorchTitan's compile sets it): the dispatch block becomes one op (no all-to-all, no ``.item()`` left),
  the output matches eager EP, gradients within bf16 rounding (aot_eager and Inductor after the pass);
  the fake implementations promise the real strides; altered graphs are left alone with the
  reason; the default moe_fuse backend leaves the EP graph alone.
"""

import operator

import pytest
import torch
import torch.distributed as dist

from support.ep_common import init_gloo, spawn_ranks
from support.models import rel_err

pytest.importorskip("torchtitan.models.common.moe")

WORLD = 2
E, K, D, I = 4, 2, 32, 16
TOL = 1e-6
GRAD_TOL = 2e-2  # TorchTitan's backward GEMMs are bf16, moe_fuse's accumulate in fp32 (as in test_torchtitan.py)


def _worker(rank: int, world: int, store_path: str, debug_dir: str):
    import warnings

    warnings.filterwarnings("ignore", message=".*CPU [Aa]utocast.*")
    init_gloo(rank, world, store_path)
    torch._dynamo.config.capture_scalar_outputs = True  # as TorchTitan's compile sets it
    try:
        _check_op(rank, world)
        _check_torchtitan(rank, world)
        _check_near_misses(rank, world)
        _check_default_backend_leaves_it(rank, world, debug_dir)
        _check_backend_option(rank, world, debug_dir)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the op


def _check_op(rank: int, world: int):
    import moe_fuse.parallel.ep_ops  # noqa: F401
    from moe_fuse.parallel.ep import _EPInfo
    from moe_fuse.parallel.overlap import ep_experts_chunked

    E6, H, I4, k = 6, 8, 4, 2
    L = E6 // world
    gen = torch.Generator().manual_seed(3)
    ep = _EPInfo(group=dist.group.WORLD, world=world, rank=rank, num_experts=E6, first_expert=rank * L)
    name = dist.group.WORLD.group_name
    gu = torch.randn(L, 2 * I4, H, generator=gen).requires_grad_()
    dn = torch.randn(L, H, I4, generator=gen).requires_grad_()
    cases = {
        "uneven": 7 + 2 * rank,
        "all to rank 0": 5,  # rank 1's experts receive no rows
        "rank 1 has no tokens": 0 if rank else 6,
    }
    for case, T in cases.items():
        choices = L if case == "all to rank 0" else E6
        ids = torch.stack([torch.randperm(choices, generator=gen)[:k] for _ in range(T)]) if T else torch.empty(0, k).long()
        x = torch.randn(T, H, generator=gen).requires_grad_()
        w = torch.rand(T, k, generator=gen).requires_grad_()
        dy = torch.randn(T, H, generator=gen)
        for chunks in (1, 2, 3):
            where = (rank, case, chunks)
            want_y = ep_experts_chunked(x, ids, w, gu, dn, ep, chunks)
            want = torch.autograd.grad(want_y, (x, w, gu, dn), dy)
            y = torch.ops.moe_fuse.ep_experts(x, ids, w, gu, dn, name, chunks)[0]
            got = torch.autograd.grad(y, (x, w, gu, dn), dy)
            pairs = [(y, want_y), *zip(got, want)]
            if case == "uneven":  # and through AOTAutograd (fake impls, saved outputs, the backward op)
                torch._dynamo.reset()
                fn = torch.compile(lambda *a: torch.ops.moe_fuse.ep_experts(*a, name, chunks)[0], backend="aot_eager",
                                   fullgraph=True)
                y_c = fn(x, ids, w, gu, dn)
                pairs += [(y_c, want_y), *zip(torch.autograd.grad(y_c, (x, w, gu, dn), dy), want)]
            for a, b in pairs:
                assert a.shape == b.shape, where
                if b.numel():
                    assert rel_err(a, b) < 1e-5 or torch.equal(a, b), (where, rel_err(a, b))
            if case == "all to rank 0" and rank == 1:
                assert not got[2].any() and not got[3].any(), where  # no rows here: zero expert gradients
    _check_fake_strides(x, ids, w, gu, dn, name)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="chunks=4 exceeds the 3 local experts"):
        torch.ops.moe_fuse.ep_experts(x, ids, w, gu, dn, name, 4)


def _check_fake_strides(x, ids, w, gu, dn, name):
    """Fake implementations promise the real outputs' shapes, dtypes, devices and strides (Inductor relies on it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # Non-contiguous weights too: the outputs must still be what the fake says.
    x, w, dn = x.detach(), w.detach(), dn.detach()
    gu = gu.detach().transpose(1, 2).contiguous().transpose(1, 2)
    real = torch.ops.moe_fuse.ep_experts(x, ids, w, gu, dn, name, 2)
    dy = torch.randn_like(real[0])
    real_bwd = torch.ops.moe_fuse.ep_experts_backward(dy, x, ids, w, real[1], gu, dn, real[2], real[3], name, 2)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    f = {id(t): mode.from_tensor(t) for t in (x, ids, w, gu, dn, dy)}
    with mode:
        fakes = torch.ops.moe_fuse.ep_experts(f[id(x)], f[id(ids)], f[id(w)], f[id(gu)], f[id(dn)], name, 2)
        fakes_bwd = torch.ops.moe_fuse.ep_experts_backward(
            f[id(dy)], f[id(x)], f[id(ids)], f[id(w)], fakes[1], f[id(gu)], f[id(dn)], fakes[2], fakes[3], name, 2
        )
    for r, f in zip((*real, *real_bwd), (*fakes, *fakes_bwd)):
        assert (r.shape, r.dtype, r.device, r.stride()) == (f.shape, f.dtype, f.device, f.stride()), (r.stride(), f.stride())


# --------------------------------------------------------------------------- TorchTitan


def _titan_moe(rank: int, world: int, seed: int = 0):
    """TorchTitan's Qwen3 MoE layer (softmax router, route_norm, load-balancing bias), its experts sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed import utils as titan_dist
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers

    titan_dist.set_spmd_backend("dtensor")  # plain functional collectives, as torch.compile sees them
    (layer,) = _build_qwen3_moe_layers(
        n_layers=1, dim=D, n_heads=4, n_kv_heads=2, head_dim=8, moe_hidden_dim=I, num_experts=E, top_k=K,
        attn_backend="flex", moe_comm_backend="standard", rope=CosSinRoPE.Config(dim=8, max_seq_len=64, theta=1e6),
    )
    moe = layer.moe.build()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        moe.expert_bias_E.copy_(torch.randn(E, generator=gen) * 0.05)
    L = E // world
    experts = moe.routed_experts.inner_experts
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        local = getattr(experts, name).detach()[rank * L : (rank + 1) * L].clone()
        setattr(experts, name, torch.nn.Parameter(local))
    moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
    return moe.train()


def _step(module, x):
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = module(x)
    (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in module.named_parameters()}
    return y.detach(), x.grad, grads


def _tokens(rank: int):
    return torch.randn(1, 6 + 3 * rank, D, generator=torch.Generator().manual_seed(5 + rank))


def _rewriting_backend(chunks, seen, inner):
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor.compile_fx import compile_fx

    from moe_fuse.patterns import ep_torchtitan

    def backend(gm, example_inputs):
        count, rejections = ep_torchtitan.rewrite(gm, chunks=chunks)
        seen.append((count, [r.reason for r in rejections], gm.code))
        if inner == "inductor":  # also holds the op's fake strides to the real ones
            return compile_fx(gm, example_inputs)
        return aot_autograd(fw_compiler=boxed_nop)(gm, example_inputs)

    return backend


def _check_torchtitan(rank: int, world: int):
    x = _tokens(rank)
    eager = _titan_moe(rank, world)
    want_y, want_dx, want_grads = _step(eager, x)
    for chunks, inner in ((1, "aot_eager"), (2, "inductor")):
        moe = _titan_moe(rank, world)
        seen = []
        torch._dynamo.reset()
        compiled = torch.compile(moe, backend=_rewriting_backend(chunks, seen, inner))
        y, dx, grads = _step(compiled, x)
        assert [s[:2] for s in seen] == [(1, [])], (rank, [s[:2] for s in seen])
        code = seen[0][2]
        assert "moe_fuse.ep_experts" in code and "all_to_all_single" not in code and ".item()" not in code, code
        assert "_assert_scalar" not in code and "_grouped_mm" not in code, code
        assert rel_err(y, want_y) <= TOL, (rank, chunks, rel_err(y, want_y))
        assert rel_err(dx, want_dx) <= GRAD_TOL, (rank, chunks, rel_err(dx, want_dx))
        assert set(grads) == set(want_grads)
        for name, g in grads.items():
            assert rel_err(g, want_grads[name]) <= GRAD_TOL, (rank, chunks, name, rel_err(g, want_grads[name]))
        # The router's load-balancing counter (a buffer written in the graph) still counts.
        assert torch.equal(moe.tokens_per_expert_E, eager.tokens_per_expert_E), rank


# --------------------------------------------------------------------------- near misses


def _capture(rank: int, world: int):
    """The Dynamo graph of TorchTitan's EP MoE (run once, so every rank's collectives take part)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(_titan_moe(rank, world), backend=backend)(_tokens(rank))
    (gm,) = graphs
    return gm


def _a2as(gm):
    from moe_fuse.patterns.ep_torchtitan import _c10d

    return [n for n in gm.graph.nodes if _c10d(n, "all_to_all_single")]


def _check_near_misses(rank: int, world: int):
    from moe_fuse.patterns import ep_torchtitan

    def rejected(gm, reason):
        before = str(gm.graph)
        count, rejections = ep_torchtitan.rewrite(gm)
        assert count == 0 and len(rejections) == 1, (reason, count, [r.reason for r in rejections])
        assert reason in rejections[0].reason, (reason, rejections[0].reason)
        assert str(gm.graph) == before  # untouched

    # The combine sends with the dispatch's splits instead of swapping them.
    gm = _capture(rank, world)
    _, dispatch, combine = _a2as(gm)
    combine.args = (combine.args[0], dispatch.args[1], dispatch.args[2], combine.args[3])
    rejected(gm, "not the dispatch reversed")

    # The rank-major -> expert-major permutation is altered (the gather no longer regroups by expert).
    gm = _capture(rank, world)
    pidx = next(n for n in gm.graph.nodes if n.name == "permuted_indices")
    assert pidx.target is operator.sub
    pidx.target = operator.add
    rejected(gm, "not rank-major -> expert-major")

    # A value inside the block is also returned by the graph.
    gm = _capture(rank, world)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    offsets = next(n for n in gm.graph.nodes if n.name == "offsets_E")
    output.args = (tuple(output.args[0]) + (offsets,),)
    rejected(gm, "the graph returns")

    # A buffer also accumulates the exchanged counts (a side effect the rewrite would drop).
    gm = _capture(rank, world)
    buffer = next(n for n in gm.graph.nodes if n.op == "placeholder" and "tokens_per_expert" in n.name)
    received = next(n for n in gm.graph.nodes if n.name == "num_global_tokens_per_local_expert_E")
    with gm.graph.inserting_after(received):
        gm.graph.call_method("add_", (buffer, received))
    rejected(gm, f"writes into {buffer.name} with values from the dispatch block")

    # The counts come from outside the graph (only the routed-experts module compiled).
    from torchtitan.models.common.moe import RoutedExperts  # noqa: F401

    moe = _titan_moe(rank, world)
    graphs = []
    torch._dynamo.reset()
    routed = torch.compile(moe.routed_experts, backend=lambda gm, _: graphs.append(gm) or gm)
    gen = torch.Generator().manual_seed(rank)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(5)]).view(1, 5, K)
    counts = torch.zeros(E, dtype=torch.int64).scatter_add_(0, ids.view(-1), torch.ones(5 * K, dtype=torch.int64))
    routed(torch.randn(1, 5, D), torch.rand(1, 5, K), ids, counts)
    rejected(graphs[0], "not computed from the top-k ids in this graph")


def _check_default_backend_leaves_it(rank: int, world: int, debug_dir: str):
    """The default passes do not touch the EP graph (their torchtitan pattern must not half-match it)."""
    x = _tokens(rank)
    want = _step(_titan_moe(rank, world), x)
    torch._dynamo.reset()
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.debug_dir": f"{debug_dir}/rank{rank}"}
    got = _step(torch.compile(_titan_moe(rank, world), backend="moe_fuse", options=options), x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for name in want[2]:
        assert torch.equal(got[2][name], want[2][name]), name
    import pathlib

    (after,) = pathlib.Path(f"{debug_dir}/rank{rank}").glob("graph_*/after.py")
    text = after.read_text()
    calls = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert sum("_c10d_functional.all_to_all_single(" in line for line in calls) == 3, text
    assert not any("torch.ops.moe_fuse" in line for line in calls), text


def _check_backend_option(rank: int, world: int, debug_dir: str):
    """options={"moe_fuse.ep_chunks": 2}: the moe_fuse backend itself rewrites the chain, and reports it."""
    import json
    import pathlib

    x = _tokens(rank)
    want_y, want_dx, want_grads = _step(_titan_moe(rank, world), x)
    torch._dynamo.reset()
    out = pathlib.Path(f"{debug_dir}/option{rank}")
    options = {"moe_fuse.inner": "aot_eager", "moe_fuse.ep_chunks": 2, "moe_fuse.debug_dir": str(out)}
    y, dx, grads = _step(torch.compile(_titan_moe(rank, world), backend="moe_fuse", options=options), x)
    assert rel_err(y, want_y) <= TOL, (rank, rel_err(y, want_y))
    assert rel_err(dx, want_dx) <= GRAD_TOL, (rank, rel_err(dx, want_dx))
    for name, g in grads.items():
        assert rel_err(g, want_grads[name]) <= GRAD_TOL, (rank, name, rel_err(g, want_grads[name]))
    (after,) = out.glob("graph_*/after.py")
    calls = [line for line in after.read_text().splitlines() if not line.lstrip().startswith("#")]
    assert sum("moe_fuse.ep_experts" in line for line in calls) == 1
    assert not any("all_to_all_single(" in line for line in calls)
    (report,) = out.glob("graph_*/report.json")
    matches = json.loads(report.read_text())["matches"]
    assert [(m["pattern"], m["chunks"]) for m in matches if m["pattern"] == "torchtitan_ep_dispatch"] == [
        ("torchtitan_ep_dispatch", 2)
    ], matches


def test_ep_dispatch_in_graphs_two_ranks(tmp_path):
    spawn_ranks(_worker, tmp_path, WORLD, "debug")


def test_other_all_to_alls_are_reported_not_skipped():
    """With moe_fuse.ep_chunks set, a graph whose all-to-all is not TorchTitan's dispatch gets a line in the
    report (transformers' AllToAllEP, broken into graphs at its .tolist(), is one), not silence. No
    process group is needed: nothing runs, the graph is only read."""
    from moe_fuse.patterns import ep_torchtitan

    graph = torch.fx.Graph()
    rows = graph.placeholder("rows")
    sent = graph.call_function(torch.ops._c10d_functional_autograd.all_to_all_single.default,
                               (rows, [3, 1], [2, 2], "0"))
    graph.output(graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (sent,)))
    matches, rejections = ep_torchtitan.find(torch.fx.GraphModule(torch.nn.Module(), graph))
    assert matches == []
    assert [(r.reason.split(":")[0], r.node) for r in rejections] == [(sent.name, sent)]
    assert "no TorchTitan token dispatch in this graph" in rejections[0].reason

    empty = torch.fx.Graph()
    empty.output(empty.placeholder("x"))
    assert ep_torchtitan.find(torch.fx.GraphModule(torch.nn.Module(), empty)) == ([], [])
