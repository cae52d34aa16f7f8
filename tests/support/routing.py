"""Router logits at the edges, shared by the interpreter and GPU tests of the router kernel."""

import torch

NAN, INF = float("nan"), float("inf")


def edge_rows(E: int, gen: torch.Generator, rows: int = 11, scale: float = 1.0) -> torch.Tensor:
    """[rows, E] logits (rows >= 10): a NaN, all NaN, all -inf, +inf entries (one, two), -inf but fewer finite
    entries than a top-8 (zeros tie), the largest float, all zero (a zero-initialised router), ties at and across
    the k-th value; the rest random, N(0, scale^2). The NaN and inf rows have an all-NaN softmax, as in torch."""
    out = torch.randn(rows, E, generator=gen) * scale
    out[0, E // 3] = NAN
    out[1] = NAN
    out[2] = -INF
    out[3, E - 1] = INF
    out[4, [1, E - 2]] = INF
    out[5] = -INF
    out[5, [0, 2, E - 1]] = torch.tensor([1.0, 3.0, 0.0])
    out[6] = torch.finfo(torch.float32).max
    out[7] = 0.0
    out[8] = 1.0
    out[8, [E - 2, 0]] = 2.0  # a tie above the rest: both picked, lowest first
    out[9] = torch.randint(0, 3, (E,), generator=gen).float()  # many ties, some across the k-th value
    return out
