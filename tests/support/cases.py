"""Random experts-block cases for the kernel and op tests, their float64 references, and poisoned buffers.

``make_case`` builds the five inputs (x, ids, weights, W_gate_up, W_down) on ``DEVICE``, with expert ids of a
routing mode (``make_ids``: uniform, skewed, two experts, one expert, expert-parallel sentinels);
``random_case`` builds float64 CPU inputs for the op tests, ``biases`` the per-expert biases of both projections.
``ref64`` and ``ref64_backward`` are moe_fuse.reference's forward and backward on float64 copies; ``NAMES``
(``BIAS_NAMES`` with the gate_up bias) name the backward's gradients. ``poisoned_buffers`` makes every buffer
the kernels allocate start as NaN or -1, so that unwritten elements show; ``rel_err`` is the relative norm.
"""

import contextlib

import torch

from moe_fuse import reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("dx", "d_weights", "d_w_gate_up", "d_w_down")
BIAS_NAMES = ("dx", "d_weights", "d_w_gate_up", "d_w_down", "d_gate_up_bias")


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def make_ids(T, k, E, mode, gen):
    """[T, k] expert ids. Distinct experts per token like top-k, except where the mode says otherwise."""
    if mode == "uniform":
        return torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    if mode == "skewed":  # a few heavy experts, some empty
        probs = torch.tensor([8.0, 4.0, 0.0, 1.0, 0.0, 2.0] + [0.5] * (E - 6))[:E]
        return torch.stack([torch.multinomial(probs, k, generator=gen) for _ in range(T)])
    if mode == "two":  # only experts 1 and E-2 get rows
        return torch.randint(0, 2, (T, k), generator=gen) * (E - 3) + 1
    if mode == "one":  # every slot on one expert (duplicates inside a token)
        return torch.full((T, k), E // 2, dtype=torch.int64)
    if mode == "sentinels":  # expert parallelism: ids >= E belong to another rank
        ids = make_ids(T, k, E, "uniform", gen)
        off_rank = torch.rand(T, k, generator=gen) < 0.3
        return torch.where(off_rank, E + torch.randint(0, 3, (T, k), generator=gen), ids)
    raise ValueError(mode)


def make_case(T, k, E, H, I, dtype, mode="uniform", w_dtype=None, r_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w_dtype = w_dtype or dtype
    r_dtype = r_dtype or dtype
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = make_ids(T, k, E, mode, gen)
    weights = torch.rand(T, k, generator=gen).to(r_dtype)
    w_gate_up = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(w_dtype)
    w_down = (torch.randn(E, H, I, generator=gen) / I**0.5).to(w_dtype)
    return [t.to(DEVICE) for t in (x, ids, weights, w_gate_up, w_down)]


def random_case(T=9, H=12, I=10, E=5, k=2, dtype=torch.float64, seed=0, sentinel_fraction=0.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen, dtype=dtype)
    ids = torch.rand(T, E, generator=gen).argsort(-1)[:, :k]
    if sentinel_fraction:
        ids[torch.rand(T, k, generator=gen) < sentinel_fraction] = E
    weights = torch.rand(T, k, generator=gen, dtype=dtype)
    w_gate_up = torch.randn(E, 2 * I, H, generator=gen, dtype=dtype) / H**0.5
    w_down = torch.randn(E, H, I, generator=gen, dtype=dtype) / I**0.5
    return x, ids, weights, w_gate_up, w_down


def biases(E, two_i, H, dtype=torch.float64, seed=11):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(E, two_i, generator=gen).to(dtype), torch.randn(E, H, generator=gen).to(dtype)


def ref64(x, ids, weights, w_gate_up, w_down):
    cpu = [t.cpu() for t in (x, ids, weights, w_gate_up, w_down)]
    return reference.experts_forward(*[t.double() if t.is_floating_point() else t for t in cpu])


def ref64_backward(dy, x, ids, weights, w_gate_up, w_down):
    cpu = [t.cpu() for t in (dy, x, ids, weights, w_gate_up, w_down)]
    return reference.experts_backward(*[t.double() if t.is_floating_point() else t for t in cpu])


@contextlib.contextmanager
def poisoned_buffers(monkeypatch):
    """Every buffer the kernels allocate starts as NaN (floats) or -1 (ints): unwritten elements show."""
    real_empty = torch.empty

    def poisoned_empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        t.fill_(float("nan") if t.is_floating_point() else -1)
        return t

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", poisoned_empty)
        yield
