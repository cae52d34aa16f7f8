"""The chunked, overlapped expert-parallel path (moe_fuse.parallel.overlap) on CPU: 2 gloo processes.

As in test_ep.py, each rank gets its own token batch (different sizes: uneven, asymmetric splits), and the
reference is the unsharded model run on each batch in one process with the gradients summed. Chunk counts
1, 2 and 3 over L = 3 local experts per rank (2 does not divide 3: groups of 2 and 1 experts). The
all-to-all calls are counted, so the test also shows that the rows really travel in N chunks each way,
forward and backward, behind one blocking count exchange.
"""

import pytest
import torch
import torch.distributed as dist

from support.ep_common import BATCHES, TOL, assert_matches_reference, expert_parameters, init_gloo, reference, spawn_ranks
from support.models import loss_and_grads, qwen3_moe, rel_err, token_batch

WORLD = 2
CHUNKS = (1, 2, 3)


def _worker(rank: int, world: int, store_path: str):
    init_gloo(rank, world, store_path)
    try:
        _check_errors(world)
        _check_edge_routing(rank, world)
        _check_model(rank, world)
    finally:
        dist.destroy_process_group()


class _CountA2A:
    """Wraps dist.all_to_all_single: counts blocking and async calls."""

    def __init__(self):
        self.blocking = self.async_ = 0
        self.inner = dist.all_to_all_single

    def __call__(self, *args, async_op=False, **kwargs):
        if async_op:
            self.async_ += 1
        else:
            self.blocking += 1
        return self.inner(*args, async_op=async_op, **kwargs)

    def __enter__(self):
        dist.all_to_all_single = self
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self.inner


def _check_errors(world: int):
    from moe_fuse.parallel import shard_experts
    from moe_fuse.parallel.overlap import expert_groups

    for bad, message in ((4, r"chunks=4 exceeds the 3 local experts"), (0, r"positive int, got 0"), (1.5, r"got 1.5")):
        model = qwen3_moe()
        with pytest.raises(ValueError, match=message):
            shard_experts(model, chunks=bad)
        assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 6  # nothing changed
        assert not hasattr(model.model.layers[0].mlp.experts, "_moe_fuse_ep")
    assert expert_groups(3, 2) == [(0, 2), (2, 3)]
    assert expert_groups(64, 4) == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert expert_groups(5, 3) == [(0, 2), (2, 4), (4, 5)]


def _check_model(rank: int, world: int):
    from moe_fuse.parallel import shard_experts

    ref = reference(rank)
    batch = token_batch(**BATCHES[rank])
    L = 6 // world
    lo, hi = rank * L, (rank + 1) * L

    for chunks in CHUNKS:
        model = shard_experts(qwen3_moe(), chunks=chunks)
        expert_names = expert_parameters(model)
        assert len(expert_names) == 4  # two MoE layers
        with _CountA2A() as calls:
            step = loss_and_grads(model, batch)
        # Per layer: the count exchange (blocking), N dispatches and N combines forward, N of each backward.
        assert (calls.blocking, calls.async_) == (2, 2 * 4 * chunks), (chunks, calls.blocking, calls.async_)
        assert_matches_reference(step, ref, expert_names, lo, hi, tag=(rank, chunks))


def _check_edge_routing(rank: int, world: int):
    """ep_experts_chunked on empty splits, against the one-process op (expert gradients all-reduced).

    Cases: nothing crosses ranks; every row goes to rank 0 (rank 1 receives zero rows); only the first
    local expert of each rank is used (the later chunks are empty everywhere); rank 1 has no tokens.
    """
    from moe_fuse.parallel.ep import _EPInfo
    from moe_fuse.parallel.overlap import ep_experts_chunked

    E, H, I, k = 6, 8, 4, 2
    L = E // world
    gen = torch.Generator().manual_seed(7)
    w_gu = torch.randn(E, 2 * I, H, generator=gen)
    w_d = torch.randn(E, H, I, generator=gen)
    ep = _EPInfo(group=dist.group.WORLD, world=world, rank=rank, num_experts=E, first_expert=rank * L)
    cases = {
        "local only": (5, rank * L + torch.randint(0, L, (5, k), generator=gen)),
        "all to rank 0": (4 + rank, torch.randint(0, L, (4 + rank, k), generator=gen)),
        "first expert of each rank": (6, L * torch.randint(0, world, (6, k), generator=gen)),
        "rank 1 has no tokens": (0 if rank else 7, torch.randint(0, E, (0 if rank else 7, k), generator=gen)),
    }
    for chunks in CHUNKS:
        for case, (T, ids) in cases.items():
            x = torch.randn(T, H, generator=gen, requires_grad=True)
            w = torch.rand(T, k, generator=gen, requires_grad=True)
            gu_local = w_gu[rank * L : (rank + 1) * L].clone().requires_grad_()
            d_local = w_d[rank * L : (rank + 1) * L].clone().requires_grad_()
            y = ep_experts_chunked(x, ids, w, gu_local, d_local, ep, chunks)
            dy = torch.randn(T, H, generator=gen)
            y.backward(dy)
            x_ref, w_ref, gu_ref, d_ref = (t.detach().clone().requires_grad_() for t in (x, w, w_gu, w_d))
            y_ref = torch.ops.moe_fuse.experts(x_ref, ids, w_ref, gu_ref, d_ref, False)[0]
            y_ref.backward(dy)
            gu_grad, d_grad = gu_ref.grad.clone(), d_ref.grad.clone()
            dist.all_reduce(gu_grad)  # expert gradients sum over every rank's tokens
            dist.all_reduce(d_grad)
            where = (rank, chunks, case)
            assert y.shape == (T, H) and x.grad.shape == (T, H), where
            if T:
                assert rel_err(y, y_ref) < TOL, where
                assert rel_err(x.grad, x_ref.grad) < TOL, where
                assert rel_err(w.grad, w_ref.grad) < TOL, where
            want_gu, want_d = gu_grad[rank * L : (rank + 1) * L], d_grad[rank * L : (rank + 1) * L]
            if want_gu.norm() == 0:  # this rank's experts received nothing: exactly zero, not garbage
                assert case in ("all to rank 0",) and rank == 1, where
                assert torch.equal(gu_local.grad, want_gu) and torch.equal(d_local.grad, want_d), where
            else:
                assert rel_err(gu_local.grad, want_gu) < TOL, where
                assert rel_err(d_local.grad, want_d) < TOL, where


def test_chunked_expert_parallel_two_ranks_match_one_process(tmp_path):
    spawn_ranks(_worker, tmp_path, WORLD)
