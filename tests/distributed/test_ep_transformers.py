"""transformers' own expert parallelism (``transformers.distributed``, 5.24) under backend="moe_fuse":
2 processes over gloo, one training step, compiled against eager and against a one-process reference.

The plan is applied the way ``from_pretrained(distributed_config=...)`` applies it, with the two class
methods it calls (``prepare_distribute_model``, ``maybe_distribute_model``) on a model built from its
config: ``from_pretrained`` itself needs ``accelerate`` for the device map it sets under a distributed
config (``integrations/accelerate.py``, ``check_and_set_device_map``), which this environment does not
have. The full random model is built on every rank; ``distribute_tensor(src_data_rank=None)`` keeps each
rank's slice.

- ``ep_implementation="all_reduce"`` needs the EP group to share one batch (``ep_size == tp_size``), so
  ``tp_size=2, ep_size=2``: attention is tensor-parallel, each rank holds the same batch, runs its 3 of
  the 6 experts on every token (routes to the other rank's experts get local id 3 with weight 0) and an
  all-reduce sums the outputs. Dynamo captures the whole step in one graph; both MoE blocks are fused
  (experts with E=3 and the sentinel masking). At inference the all-reduce writes into the experts'
  output in place, after the block: still fused, the write kept (test_region_writes.py).
- ``ep_implementation="all_to_all"`` with ``fsdp_size=2, ep_size=2`` (transformers requires ep_size to
  divide fsdp_size * tp_size): FSDP2 on the dense modules, each rank its own batch (of different sizes,
  so the splits are uneven), tokens exchanged with all-to-all. The FSDP hooks and the ``.tolist()`` of the
  split sizes break the graph; the experts (top-1 on the received rows, unit weights) land in a graph of
  their own with the combine's all-to-all, fused, once static and once after the automatic dynamic
  recompile; the router graph is compiled once and reused by the second layer.

Gradients are compared in full (``DTensor.full_tensor()``). FSDP2 averages over the 2 batches (the
experts too: transformers sets their divide factor to dp_size), so the reference there is the mean of
the one-process gradients over the two batches.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist

from support.ep_common import init_gloo, spawn_ranks
from support.models import loss_and_grads, qwen3_moe, rel_err, token_batch

WORLD = 2
TOL = 1e-5
# One batch per rank for all_to_all (different sizes); all_reduce runs BATCHES[0] on both ranks.
BATCHES = [dict(batch=2, seq=12, seed=1), dict(batch=1, seq=9, seed=2)]
OPTIONS = {"moe_fuse.inner": "aot_eager"}

ROUTER = ("softmax_topk_router", 6, 2, None)
# What moe_fuse reports as rewritten, over every graph Dynamo compiled: (pattern, E, k, EP sentinels).
EXPECTED = {
    "all_reduce": sorted([("grouped_mm_experts", 3, 2, True)] * 2 + [ROUTER] * 2),
    "all_to_all": sorted([("grouped_mm_experts", 3, 1, True)] * 2 + [ROUTER]),
}


def _distributed_model(impl: str):
    from transformers.distributed import DistributedConfig

    if impl == "all_reduce":
        config = DistributedConfig(tp_size=WORLD, ep_size=WORLD, ep_implementation=impl)
    else:
        config = DistributedConfig(fsdp_size=WORLD, ep_size=WORLD, ep_implementation=impl)
    model = qwen3_moe()
    cls = type(model)
    config, _, mesh_manager = cls.prepare_distribute_model(config)
    return cls.maybe_distribute_model(model, config, mesh_manager)


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _step(model, ids):
    """Loss, logits, aux loss and every parameter gradient (gathered in full) of one training step."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n.removeprefix("_orig_mod."): _full(p.grad.detach()).clone()
             for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), _full(out.logits.detach()), out.aux_loss.detach(), grads


def _reference(impl: str, rank: int):
    if impl == "all_reduce":  # both ranks hold the same batch
        return loss_and_grads(qwen3_moe(), token_batch(**BATCHES[0]))
    outs = [loss_and_grads(qwen3_moe(), token_batch(**b)) for b in BATCHES]
    grads = {n: sum(o[3][n] for o in outs) / WORLD for n in outs[0][3]}
    return (*outs[rank][:3], grads)


def _assert_close(got, want, tag):
    loss, logits, aux, grads = got
    want_loss, want_logits, want_aux, want_grads = want
    assert rel_err(loss, want_loss) < TOL, (*tag, "loss", loss, want_loss)
    assert rel_err(logits, want_logits) < TOL, (*tag, "logits", rel_err(logits, want_logits))
    assert rel_err(aux, want_aux) < TOL, (*tag, "aux", aux, want_aux)
    assert set(grads) == set(want_grads), (*tag, set(grads) ^ set(want_grads))
    for name in sorted(grads):
        assert grads[name].shape == want_grads[name].shape, (*tag, name)
        err = rel_err(grads[name], want_grads[name])
        assert err < TOL, (*tag, name, err)


def _reports(debug_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(debug_dir.glob("graph_*/report.json"))]


def _check(rank: int, impl: str, debug_dir: Path):
    from torch._dynamo.utils import counters

    model = _distributed_model(impl)
    experts = model.model.layers[0].mlp.experts
    assert experts.num_experts == 3 and experts._is_expert_parallel
    assert experts.gate_up_proj.to_local().shape[0] == 3

    ids = token_batch(**BATCHES[0 if impl == "all_reduce" else rank])
    eager = _step(model, ids)
    _assert_close(eager, _reference(impl, rank), (rank, impl, "eager vs reference"))

    compiled = torch.compile(model, backend="moe_fuse", options={**OPTIONS, "moe_fuse.debug_dir": str(debug_dir)})
    for attempt in range(2):  # the second step runs the cached graphs
        _assert_close(_step(compiled, ids), eager, (rank, impl, "compiled vs eager", attempt))

    reports = _reports(debug_dir)
    rewritten = sorted((m["pattern"], m["num_experts"], m["top_k"], m.get("expert_parallel_sentinels"))
                       for r in reports for m in r["matches"])
    assert rewritten == EXPECTED[impl], (rank, impl, rewritten)
    assert all(m["verified"] is True for r in reports for m in r["matches"])
    assert [x for r in reports for x in r["rejected"]] == [], (rank, impl)
    if impl == "all_reduce":  # the whole step in one graph
        assert len(reports) == 1 and not counters["graph_break"], (rank, len(reports), dict(counters["graph_break"]))
        _check_inference(model, ids, debug_dir.with_name(f"{debug_dir.name}_inference"), (rank, impl))
    else:  # FSDP hooks and the split sizes' .tolist() break it
        assert len(reports) > 1 and counters["graph_break"]


def _check_inference(model, ids, debug_dir: Path, tag):
    """Without gradients AllReduceEP writes the all-reduced sum into the experts' output in place (a copy_
    after the block): the block is still fused, and the write lands in the fused op's output."""
    with torch.no_grad():
        want = _full(model(input_ids=ids).logits)
        options = {**OPTIONS, "moe_fuse.debug_dir": str(debug_dir)}
        got = _full(torch.compile(model, backend="moe_fuse", options=options)(input_ids=ids).logits)
    assert rel_err(got, want) < TOL, (*tag, "inference", rel_err(got, want))
    reports = _reports(debug_dir)
    rewritten = sorted((m["pattern"], m["num_experts"], m["top_k"], m.get("expert_parallel_sentinels"))
                       for r in reports for m in r["matches"])
    assert rewritten == EXPECTED["all_reduce"], (*tag, "inference", rewritten)
    assert [x for r in reports for x in r["rejected"]] == [], (*tag, "inference")


def _worker(rank: int, world: int, store_path: str, debug_root: str, impl: str):
    init_gloo(rank, world, store_path)
    try:
        _check(rank, impl, Path(debug_root) / f"rank{rank}")
    finally:
        dist.destroy_process_group()


def _run(impl: str, tmp_path: Path):
    spawn_ranks(_worker, tmp_path, WORLD, "debug", extra=(impl,))


def test_all_reduce_ep_compiled_matches_eager_and_one_process(tmp_path):
    _run("all_reduce", tmp_path)


def test_all_to_all_ep_compiled_matches_eager_and_one_process(tmp_path):
    _run("all_to_all", tmp_path)
