"""spawn_ranks (ep_common.py): a rank killed by a signal gets one more try (its Python stacks shown), a rank
that raises does not."""

import os
import pathlib

import pytest
import torch.multiprocessing as mp

import torch.distributed as dist

from support.ep_common import init_gloo, spawn_ranks


def _abort_on_first_try(rank: int, world: int, store_path: str, log_dir: str):
    init_gloo(rank, world, store_path)
    pathlib.Path(log_dir).mkdir(exist_ok=True)
    (pathlib.Path(log_dir) / f"rank{rank}").touch()
    if rank == 1 and "try1" in store_path:
        os.abort()
    dist.destroy_process_group()


def _always_abort(rank: int, world: int, store_path: str):
    if rank == 1:
        os.abort()


def _raise(rank: int, world: int, store_path: str):
    raise ValueError(f"rank {rank} failed")


def test_signal_death_is_retried_once(tmp_path):
    # The warning carries the dead rank's Python stack.
    with pytest.warns(UserWarning, match=r"(?s)died by SIGABRT.*Fatal Python error: Aborted.*_abort_on_first_try"):
        spawn_ranks(_abort_on_first_try, tmp_path, 2, "log")
    assert sorted(p.name for p in (tmp_path / "try2" / "log").iterdir()) == ["rank0", "rank1"]


def test_second_signal_death_fails(tmp_path):
    with pytest.warns(UserWarning, match="died by SIGABRT"), pytest.raises(AssertionError, match="SIGABRT"):
        spawn_ranks(_always_abort, tmp_path, 2)
    assert (tmp_path / "try2").is_dir()


def test_raising_rank_is_not_retried(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match="failed"):
        spawn_ranks(_raise, tmp_path, 2)
    assert not (tmp_path / "try2").exists()
