"""Inputs, the float64 reference and poisoned buffers for the GPU tests (Qwen3-30B-A3B's experts layer)."""

import contextlib

import torch

from moe_fuse import dispatch, reference

H, I, E, K = 2048, 768, 128, 8
NAMES = ("y", "dx", "d_weights", "dW_gate_up", "dW_down", "d_gate_up_bias")
TOL = 1e-2  # bf16 against float64; bf16 rounding alone lands at 2e-3 to 4e-3


def make_case(T, routing="uneven", dtype=torch.bfloat16, weights_dtype=None, ungated=False, seed=0):
    """(x, ids, weights, w_gate_up, w_down, dy) on the GPU, fresh random draws. Routing "uneven": Zipf-like
    popularity with every 16th expert never chosen; "sentinels": a quarter of the slots on other ranks' experts
    (ids >= E); "balanced": T k / E rows per expert."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    if routing == "balanced":
        base = (torch.arange(T, device="cuda")[:, None] + torch.arange(K, device="cuda") * (E // K)) % E
        ids = torch.randperm(E, device="cuda", generator=gen)[base]
    else:
        p = 1.0 / (torch.randperm(E, device="cuda", generator=gen).double() + 1.0) ** 1.1
        p[::16] = 0
        ids = torch.multinomial(p.float().expand(T, E), K, replacement=False, generator=gen)
        if routing == "sentinels":
            ids = torch.where(torch.rand(ids.shape, device="cuda", generator=gen) < 0.25, E + (ids % 3), ids)
    scores = torch.rand(T, K, device="cuda", generator=gen) + 0.05
    weights = (scores / scores.sum(-1, keepdim=True)).to(weights_dtype or dtype)
    w_gate_up = (rand(E, I if ungated else 2 * I, H) * H**-0.5).to(dtype)  # h of about N(0, 1)
    w_down = (rand(E, H, I) * I**-0.5).to(dtype)
    return rand(T, H).to(dtype), ids, weights, w_gate_up, w_down, rand(T, H).to(dtype)


def ref64(x, ids, weights, w_gate_up, w_down, dy, swiglu_limit=None, **gate):
    """y and every gradient in float64 on the same inputs (the clamp bound as the inputs' dtype holds it)."""
    f64 = [t.double() if t is not None and t.is_floating_point() else t for t in (x, ids, weights, w_gate_up, w_down)]
    gate = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in gate.items()}
    gate["swiglu_limit"] = reference.limit_in(x.dtype, swiglu_limit)
    return (reference.experts_forward(*f64, **gate), *reference.experts_backward(dy.double(), *f64, **gate))


def forward_backward(x, ids, weights, w_gate_up, w_down, dy, **gate):
    """The training forward (h and the sorted rows kept) and the backward reading them, on the path that dispatch
    picks under the current config: (y, dx, d_weights, dW_gate_up, dW_down[, d_gate_up_bias])."""
    y, h, routing, xs, aw = dispatch.experts_forward(x, ids, weights, w_gate_up, w_down, save_h=True, keep_rows=True,
                                                     **gate)
    return (y, *dispatch.experts_backward(dy, x, ids, weights, w_gate_up, w_down, h, routing=routing, xs=xs, aw=aw,
                                          **gate))


def qwen3_block(T=4096, dtype=torch.bfloat16, hidden=H, intermediate=I):
    """transformers' Qwen3-MoE sparse block at 30B-A3B's size (or ``hidden`` and ``intermediate``: 4096, 1536 for
    235B-A22B) on the GPU, random weights (the router's too), and x, dy [1, T, hidden] drawn after them."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=E, num_experts_per_tok=K,
                         norm_topk_prob=True)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(T)
    with torch.device("cuda"):
        block = Qwen3MoeSparseMoeBlock(cfg).to(dtype)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, 0.02)
        return block, torch.randn(1, T, hidden, dtype=dtype), torch.randn(1, T, hidden, dtype=dtype)


@contextlib.contextmanager
def poisoned(monkeypatch):
    """Every tensor allocated by torch.empty, empty_like or new_empty inside starts as NaN (floats) or -1 (ints): an
    output element the kernels never write shows."""
    def fill(t):
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", lambda *a, **kw: fill(empty(*a, **kw)))
        m.setattr(torch, "empty_like", lambda *a, **kw: fill(empty_like(*a, **kw)))
        m.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: fill(new_empty(self, *a, **kw)))
        yield


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def check(got, want, again=None, tol=TOL, loose=()):
    """Every output finite, within tol of float64 (the outputs named in ``loose`` within 0.1), and (given a second
    run) bitwise equal to it."""
    errs = {n: rel_err(g, w) for n, g, w in zip(NAMES, got, want)}
    assert all(bool(torch.isfinite(g).all()) for g in got), errs
    assert all(e < (0.1 if n in loose else tol) for n, e in errs.items()), errs
    if again is not None:
        assert all(torch.equal(a, b) for a, b in zip(got, again)), "two runs differ"
    return errs


def needs_sm90():
    import pytest

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the grouped_mm path needs sm90+")
