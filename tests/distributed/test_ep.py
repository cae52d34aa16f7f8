"""Expert parallelism (moe_fuse.parallel.ep) on CPU: 2 processes over gloo against a one-process reference.

Each rank gets its own token batch (of a different size, so the all-to-all splits are uneven and
asymmetric). The reference runs the unsharded model on each rank's batch separately and sums the
gradients, which is what one EP + data-parallel step computes: each rank's loss and logits match the
reference on its batch, its expert slices' gradients match the slices of the summed reference gradients,
and the other gradients match after an all-reduce.
"""

import pytest
import torch
import torch.distributed as dist

from support.ep_common import BATCHES, TOL, assert_matches_reference, expert_parameters, init_gloo, reference, spawn_ranks
from support.models import loss_and_grads, qwen3_moe, rel_err, token_batch

WORLD = 2


def _worker(rank: int, world: int, store_path: str):
    init_gloo(rank, world, store_path)
    try:
        _check(rank, world)
    finally:
        dist.destroy_process_group()


def _check(rank: int, world: int):
    from moe_fuse.parallel import shard_experts

    ref = reference(rank)

    # E not divisible by the group size: a clear error, nothing changed.
    odd = qwen3_moe(num_experts=5)
    with pytest.raises(ValueError, match=rf"E=5 .*world size {world}"):
        shard_experts(odd)
    assert odd.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 5

    # An experts module the EP path would compute wrongly (here another activation): a clear error, nothing changed.
    gelu = qwen3_moe()
    gelu.model.layers[1].mlp.experts.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match=r"activation GELU, not silu.*nothing was sharded"):
        shard_experts(gelu)
    assert gelu.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 6
    # ... and one the single-device op fuses (tanh gelu, Gemma 4) but the EP path does not compute yet.
    tanh = qwen3_moe()
    tanh.model.layers[0].mlp.experts.act_fn = torch.nn.GELU(approximate="tanh")
    with pytest.raises(ValueError, match=r"a gelu gate, which the expert-parallel path does not take yet"):
        shard_experts(tanh)
    assert tanh.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 6

    _check_edge_splits(rank, world)

    model = shard_experts(qwen3_moe())
    L = 6 // world
    lo, hi = rank * L, (rank + 1) * L
    expert_names = expert_parameters(model)
    routed = []
    for module in model.modules():
        if hasattr(module, "_moe_fuse_ep"):
            assert module.gate_up_proj.shape[0] == L and module.down_proj.shape[0] == L
            module.register_forward_hook(lambda m, args, out: routed.append(args[1].detach().clone()))
    assert len(expert_names) == 4  # two MoE layers

    step = loss_and_grads(model, token_batch(**BATCHES[rank]))

    # The batch really crosses ranks: rows go to local and to remote experts.
    ids = torch.cat([r.reshape(-1) for r in routed])
    assert ((ids >= lo) & (ids < hi)).any() and ((ids < lo) | (ids >= hi)).any()

    assert_matches_reference(step, ref, expert_names, lo, hi, tag=(rank,))


def _check_edge_splits(rank: int, world: int):
    """ep_experts itself on empty splits: rows only to local experts, then a rank with no tokens at all."""
    from moe_fuse.parallel.ep import _EPInfo, ep_experts

    E, H, I, k = 4, 8, 4, 2
    L = E // world
    gen = torch.Generator().manual_seed(7)
    w_gu = torch.randn(E, 2 * I, H, generator=gen)
    w_d = torch.randn(E, H, I, generator=gen)
    ep = _EPInfo(group=dist.group.WORLD, world=world, rank=rank, num_experts=E, first_expert=rank * L)
    for T, ids in (
        (5, rank * L + torch.randint(0, L, (5, k), generator=gen)),  # nothing crosses ranks
        (0 if rank else 6, torch.randint(0, E, (0 if rank else 6, k), generator=gen)),  # rank 1 has no tokens
    ):
        x = torch.randn(T, H, generator=gen, requires_grad=True)
        w = torch.rand(T, k, generator=gen, requires_grad=True)
        gu_local = w_gu[rank * L : (rank + 1) * L].clone().requires_grad_()
        d_local = w_d[rank * L : (rank + 1) * L].clone().requires_grad_()
        y = ep_experts(x, ids, w, gu_local, d_local, ep)
        dy = torch.randn(T, H, generator=gen)
        y.backward(dy)
        x_ref, w_ref, gu_ref, d_ref = (t.detach().clone().requires_grad_() for t in (x, w, w_gu, w_d))
        y_ref = torch.ops.moe_fuse.experts(x_ref, ids, w_ref, gu_ref, d_ref, False)[0]
        y_ref.backward(dy)
        # Expert gradients sum over every rank's tokens.
        gu_grad, d_grad = gu_ref.grad.clone(), d_ref.grad.clone()
        dist.all_reduce(gu_grad)
        dist.all_reduce(d_grad)
        if T:
            assert rel_err(y, y_ref) < TOL and rel_err(x.grad, x_ref.grad) < TOL and rel_err(w.grad, w_ref.grad) < TOL
        else:
            assert y.shape == (0, H) and x.grad.shape == (0, H)
        assert rel_err(gu_local.grad, gu_grad[rank * L : (rank + 1) * L]) < TOL
        assert rel_err(d_local.grad, d_grad[rank * L : (rank + 1) * L]) < TOL


def test_expert_parallel_two_ranks_match_one_process(tmp_path):
    spawn_ranks(_worker, tmp_path, WORLD)
