"""What the 2-process expert-parallel model tests share: the gloo set-up, the one-process reference and
the comparison of a sharded model's step against it (test_ep.py, test_ep_chunked.py)."""

import datetime
import faulthandler
import os
import pathlib
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .models import loss_and_grads, qwen3_moe, rel_err, token_batch

TOL = 1e-5
BATCHES = [dict(batch=2, seq=12, seed=1), dict(batch=1, seq=9, seed=2)]  # one per rank, of different sizes


_FAULTS = []  # the open file faulthandler writes to (it must stay open)


def _fault_file(store_path: str, rank: int) -> pathlib.Path:
    return pathlib.Path(store_path).parent / f"faults_rank{rank}.txt"


def init_gloo(rank: int, world: int, store_path: str) -> None:
    # A rank that dies by a signal (a C++ abort, a crash) writes every thread's Python stack to a file
    # that spawn_ranks shows (the test's captured output is not shown when the second try passes).
    _FAULTS.append(open(_fault_file(store_path, rank), "w"))
    faulthandler.enable(file=_FAULTS[-1], all_threads=True)
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    # A generous timeout: on a loaded 2-core machine one rank may still be compiling while the other waits.
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    # Gloo's set-up can return on one rank while another still connects to it: a rank that went on and left
    # at once (or died on purpose, test_ep_common) closed the connection under the other ("Connection closed by
    # peer" in init_process_group, a raise that is never retried). Every rank is connected past this barrier.
    dist.barrier()


def _run_rank(rank: int, worker, *args) -> None:
    worker(rank, *args)
    # Passed: leave without the interpreter's teardown. A rank once died by SIGABRT ("terminate called
    # without an active exception") with no Python frame on any thread, i.e. after its checks, while C++
    # threads were destroyed at exit (a full local run of the suite repeated it once).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(worker, tmp_path: pathlib.Path, world: int, *dirs: str, extra: tuple = ()) -> None:
    """Run ``worker(rank, world, store_path, *dir_paths, *extra)`` on ``world`` gloo processes (fresh paths
    per try).

    A rank that *raises* fails the test at once. A rank that passes exits without the interpreter's teardown
    (``_run_rank``): in one CI run a rank of test_ep_chunked died with SIGABRT, "terminate called without an
    active exception", from inside the C++ runtime and with no Python error, and a later local run of the
    whole suite showed the same in test_ep with no Python frame on any thread. A rank killed by a signal
    still gets one more try; its Python stacks (faulthandler, ``init_gloo``) go into the warning, and a
    second death fails the test with them.
    """
    for attempt in (1, 2):
        root = tmp_path / f"try{attempt}"
        root.mkdir()
        args = (world, str(root / "store"), *(str(root / d) for d in dirs), *extra)
        try:
            mp.spawn(_run_rank, args=(worker, *args), nprocs=world, join=True)
            return
        except mp.ProcessExitedException as e:
            faults = _fault_file(args[1], e.error_index)
            stacks = faults.read_text()[-4000:] if faults.exists() else "(no stacks written)"
            if e.signal_name is None or attempt == 2:
                raise AssertionError(f"gloo rank {e.error_index}: {e}; its Python stacks:\n{stacks}") from e
            warnings.warn(f"a gloo rank died by {e.signal_name} ({e}); running the ranks once more. "
                          f"Its Python stacks:\n{stacks}")


def reference(rank: int):
    """The unsharded model run on each rank's batch in one process: (this rank's loss, logits, aux loss),
    and the gradients summed over the batches -- what one EP + data-parallel step computes."""
    batches = [token_batch(**b) for b in BATCHES]
    outs = [loss_and_grads(qwen3_moe(), ids) for ids in batches]
    grads = {n: sum(out[3][n] for out in outs) for n in outs[0][3]}
    return (*outs[rank][:3], grads)


def expert_parameters(model) -> set:
    """Names of the sharded experts' parameters."""
    return {f"{name}.{w}" for name, m in model.named_modules() if hasattr(m, "_moe_fuse_ep")
            for w in ("gate_up_proj", "down_proj")}


def assert_matches_reference(step, ref, expert_names: set, lo: int, hi: int, tag=()):
    """``step`` = (loss, logits, aux, grads) of this rank's sharded model on its batch. Loss, logits and aux
    match the reference on the same batch; expert gradients match the reference's slice [lo, hi) (they
    already sum every rank's tokens); the others match after an all-reduce."""
    loss, logits, aux, grads = step
    ref_loss, ref_logits, ref_aux, ref_grads = ref
    assert rel_err(loss, ref_loss) < TOL, (*tag, loss, ref_loss)
    assert rel_err(logits, ref_logits) < TOL, (*tag, rel_err(logits, ref_logits))
    assert rel_err(aux, ref_aux) < TOL, (*tag, aux, ref_aux)
    assert set(grads) == set(ref_grads)
    for name in sorted(grads):
        g = grads[name]
        if name in expert_names:
            want = ref_grads[name][lo:hi]
        else:
            dist.all_reduce(g)
            want = ref_grads[name]
        assert g.shape == want.shape, (name, g.shape, want.shape)
        err = rel_err(g, want)
        assert err < TOL, (*tag, name, err)
