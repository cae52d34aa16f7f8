"""With verification off (``moe_fuse.verify=False``) the structural match alone decides: it must never take a graph
that only looks like the pattern.

A reference block, transformers' softmax top-k router (Qwen3-MoE) and its ``grouped_mm`` experts forward
(integrations/moe.py) written out, is mutated one literal, dim, index, operand or in-place write at a time. The sizes
are drawn so that the wrong axis has the size of the right one where that is what makes a mutation dangerous
(S == H, T == k, square weights): a shape check alone does not see those. For every mutation, compiled with
``verify=False``, either the pattern is not matched or the compiled block gives what the mutated block gives
eagerly: its output and the gradient of every input, on the inputs it was compiled with and on fresh ones.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from moe_fuse.debug import collect_reports

OPTIONS = {"moe_fuse.verify": False, "moe_fuse.inner": "aot_eager"}
EXPERTS, ROUTER = "grouped_mm_experts", "softmax_topk_router"
TOL = 1e-4  # fp32 on both sides: far above rounding, far below any mutation here


@dataclasses.dataclass(frozen=True)
class Sizes:
    T: int  # tokens
    k: int  # experts per token
    E: int  # experts
    H: int  # hidden size
    I: int  # intermediate size (gate_up has 2I rows)
    renorm: bool  # the router's norm_topk_prob
    ep: bool = False  # the expert-parallel sentinel masks (transformers' _is_expert_parallel)

    @property
    def S(self):
        return self.T * self.k


@dataclasses.dataclass(frozen=True)
class Mutation:
    needs: tuple = ()  # what makes it the dangerous kind: "S == H", "T == k", "T == E", "H == 2I", "H == I",
    #                    "E == H", "renorm", "no renorm", "ep"
    changes: bool = True  # False: an equivalent spelling (the block computes the same)


MUTATIONS = {
    "none": Mutation(changes=False),
    # the un-permutation: inv[perm] = arange(S)
    "unpermute_reversed": Mutation(),  # arange(S - 1, -1, -1)
    "unpermute_start": Mutation(),  # arange(-1, S - 1): a rotation (-1 indexes the last row)
    "unpermute_step": Mutation(),  # arange(0, -S, -1): 0, S-1, S-2, ...
    "unpermute_by_perm": Mutation(),  # rows[perm] instead of rows[inv]
    "unpermute_extra_write": Mutation(),  # one more write into inv
    # the routing weights of the rows
    "weights_unsqueeze0": Mutation(("S == H",)),  # a [1, S] row broadcast along H
    "weights_view_row": Mutation(("S == H",)),  # the same, as view(1, -1)
    "weights_gathered_flipped": Mutation(),
    "weights_transposed": Mutation(("T == k",), changes=False),  # weights.t() paired with ids.t(): the same pairs
    # the gathered rows, the sort, the offsets
    "rows_mod_k": Mutation(),  # x[perm % k]
    "rows_div_k_plus_1": Mutation(),  # x[perm // (k + 1)]
    "rows_scaled_in_place": Mutation(),  # rows.mul_(2)
    "rows_bf16_round_trip": Mutation(),  # rows.to(bf16).to(fp32) before the GEMM
    "sort_descending": Mutation(),
    "sort_stable": Mutation(changes=False),
    "histc_unsorted": Mutation(changes=False),  # the same counts, another graph
    # the GEMMs and the activation
    "h_scaled_in_place": Mutation(),  # h.mul_(0.5) after the gate_up GEMM
    "gate_up_untransposed": Mutation(("H == 2I",)),
    "down_untransposed": Mutation(("H == I",)),
    "silu_of_up": Mutation(),  # silu(up) * gate
    "interleaved_swapped": Mutation(),  # gate, up = h[..., 1::2], h[..., ::2]
    # the combine
    "combine_sum_dim0": Mutation(("T == k",)),  # view(k, T, H).sum(0)
    "combine_sum_bf16": Mutation(),  # .sum(dim=1, dtype=bf16)
    # expert-parallel sentinels: (ids >= E)[:, None], clamp_(max=E-1), masked_fill(mask, 0) x 3
    "sentinel_mask_ge0": Mutation(("ep",)),  # every row masked
    "sentinel_fill_one": Mutation(("ep",)),  # the down GEMM's sentinel rows filled with 1
    # the router
    "router_softmax_dim0": Mutation(),
    "router_softmax_bf16_positional": Mutation(),  # torch.softmax(logits, -1, torch.bfloat16)
    "router_topk_smallest": Mutation(),
    "router_topk_dim0": Mutation(("T == E",)),
    "router_renorm_dim0": Mutation(("renorm",)),
    "router_renorm_no_keepdim": Mutation(("renorm", "T == k")),  # a [T] sum broadcast along k
    "router_renorm_bf16_sum": Mutation(("renorm",)),
    "router_values_scaled_in_place": Mutation(("no renorm",)),  # values.mul_(2)
    "router_weight_transposed": Mutation(("E == H",)),  # linear(x, W.t()): another router, read as such
}


# --------------------------------------------------------------------------- the reference block


def router(x, w_router, s: Sizes, m: str):
    """Qwen3-MoE's router: softmax in fp32, top-k, optional renorm, cast back."""
    logits = F.linear(x, w_router.t() if m == "router_weight_transposed" else w_router)
    if m == "router_softmax_dim0":
        probs = F.softmax(logits, dim=0, dtype=torch.float)
    elif m == "router_softmax_bf16_positional":  # torch.softmax(input, dim, dtype): the dtype is argument 2
        probs = torch.softmax(logits, -1, torch.bfloat16)
    else:
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
    if m == "router_topk_smallest":
        values, ids = torch.topk(probs, s.k, dim=-1, largest=False)
    elif m == "router_topk_dim0":
        values, ids = torch.topk(probs, s.k, dim=0)
    else:
        values, ids = torch.topk(probs, s.k, dim=-1)
    if m == "router_values_scaled_in_place":
        values.mul_(2.0)
    if s.renorm:
        if m == "router_renorm_dim0":
            values /= values.sum(dim=0, keepdim=True)
        elif m == "router_renorm_no_keepdim":
            values = values / values.sum(dim=-1)
        elif m == "router_renorm_bf16_sum":
            values /= values.sum(dim=-1, keepdim=True, dtype=torch.bfloat16)
        else:
            values /= values.sum(dim=-1, keepdim=True)
    return logits, values.to(logits.dtype), ids


def grouped_mm(a, w, offs):
    """transformers' _grouped_mm on the CPU in fp32: its fallback op (torch._grouped_mm's meta wants bf16)."""
    return torch.ops.transformers.grouped_mm_fallback(a, w, offs=offs)


def experts(x, ids, weights, w_gate_up, w_down, s: Sizes, m: str):
    """transformers' grouped_mm_experts_forward: gated SwiGLU, weights [E, out, in], optional EP sentinel masks."""
    k, H, E = ids.shape[-1], x.shape[-1], w_gate_up.shape[0]
    if m == "weights_transposed":
        weights, ids = weights.t(), ids.t()
    sample_weights = weights.reshape(-1)
    expert_ids = ids.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids, descending=m == "sort_descending", stable=m == "sort_stable")
    if m == "rows_mod_k":
        rows = x[perm % k]
    elif m == "rows_div_k_plus_1":
        rows = x[perm // (k + 1)]
    else:
        rows = x[perm // k]
    sample_weights_g = sample_weights[perm.flip(0) if m == "weights_gathered_flipped" else perm]
    hist_in = expert_ids.float() if m == "histc_unsorted" else expert_ids_g.float()
    offsets = torch.cumsum(torch.histc(hist_in, bins=E, min=0, max=E - 1), dim=0, dtype=torch.int32)
    mask = None
    if s.ep:
        mask = (expert_ids_g >= (0 if m == "sentinel_mask_ge0" else E)).unsqueeze(-1)
        expert_ids_g.clamp_(max=E - 1)
        rows.masked_fill_(mask, 0.0)
    if m == "rows_scaled_in_place":
        rows.mul_(2.0)
    if m == "rows_bf16_round_trip":
        rows = rows.to(torch.bfloat16)
    w_gu = w_gate_up if m == "gate_up_untransposed" else w_gate_up.transpose(-2, -1)
    h = grouped_mm(rows.to(w_gu.dtype), w_gu, offsets)
    if m == "h_scaled_in_place":
        h.mul_(0.5)
    if mask is not None:
        h = h.masked_fill(mask, 0.0)
    if m == "interleaved_swapped":
        gate, up = h[..., 1::2], h[..., ::2]
    else:
        gate, up = h.chunk(2, dim=-1)
    act = F.silu(up) * gate if m == "silu_of_up" else F.silu(gate) * up
    w_d = w_down if m == "down_untransposed" else w_down.transpose(-2, -1)
    y = grouped_mm(act.to(w_d.dtype), w_d, offsets)
    if mask is not None:
        y = y.masked_fill(mask, 1.0 if m == "sentinel_fill_one" else 0.0)
    if m == "weights_unsqueeze0":
        weighted = y * sample_weights_g.unsqueeze(0)
    elif m == "weights_view_row":
        weighted = y * sample_weights_g.view(1, -1)
    else:
        weighted = y * sample_weights_g.unsqueeze(-1)
    S = perm.size(0)
    inv = torch.empty_like(perm)
    if m == "unpermute_reversed":
        inv[perm] = torch.arange(S - 1, -1, -1)
    elif m == "unpermute_start":
        inv[perm] = torch.arange(-1, S - 1)
    elif m == "unpermute_step":
        inv[perm] = torch.arange(0, -S, -1)
    elif m == "unpermute_by_perm":
        inv = perm
    else:
        inv[perm] = torch.arange(S)
    if m == "unpermute_extra_write":
        inv[0] = S - 1
    unperm = weighted[inv]
    if m == "combine_sum_dim0":
        out = unperm.view(k, -1, H).sum(dim=0)
    elif m == "combine_sum_bf16":
        out = unperm.view(-1, k, H).sum(dim=1, dtype=torch.bfloat16)
    else:
        out = unperm.view(-1, k, H).sum(dim=1)
    return out.to(x.dtype)


def block(s: Sizes, m: str):
    def forward(x, w_router, w_gate_up, w_down):
        _, weights, ids = router(x, w_router, s, m)
        if s.ep:  # expert 0 lives on another rank: its slots come as the sentinel id E
            ids = torch.where(ids == 0, w_gate_up.shape[0], ids)
        return experts(x, ids, weights, w_gate_up, w_down, s, m)

    return forward


# --------------------------------------------------------------------------- running it


@st.composite
def sizes_for(draw, mutation: str):
    """Sizes where ``mutation`` is the dangerous kind (its wrong axis has the right size), others drawn freely."""
    needs = MUTATIONS[mutation].needs
    k = draw(st.integers(2, 3))
    E = draw(st.integers(max(k, 3), 6))
    T = k if "T == k" in needs else E if "T == E" in needs else draw(st.integers(2, 6))
    I = draw(st.sampled_from([2, 4, 6]))
    if "S == H" in needs:
        H = T * k
    elif "H == 2I" in needs:
        H = 2 * I
    elif "H == I" in needs:
        H = I
    elif "E == H" in needs:
        H = E
    else:
        H = draw(st.sampled_from([4, 6, 8, 12]))
    renorm = "renorm" in needs or ("no renorm" not in needs and draw(st.booleans()))
    ep = "ep" in needs or draw(st.booleans())
    return Sizes(T=T, k=k, E=E, H=H, I=I, renorm=renorm, ep=ep)


def inputs(s: Sizes, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(s.T, s.H, generator=gen),
        torch.randn(s.E, s.H, generator=gen),
        torch.randn(s.E, 2 * s.I, s.H, generator=gen) * s.H**-0.5,
        torch.randn(s.E, s.H, s.I, generator=gen) * s.I**-0.5,
    ]


def run(fn, args, seed: int):
    """fn's output and the gradient of every input, for a random cotangent."""
    leaves = [a.detach().clone().requires_grad_() for a in args]
    out = fn(*leaves)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    grads = torch.autograd.grad(out, leaves, cotangent, allow_unused=True)
    return [out.detach()] + [torch.zeros_like(a) if g is None else g for a, g in zip(args, grads)]


def rel_err(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12)).item()


def differences(got, want) -> dict:
    names = ["output", "grad x", "grad w_router", "grad w_gate_up", "grad w_down"]
    if any(g.shape != w.shape for g, w in zip(got, want)):
        return {"shapes": [(tuple(g.shape), tuple(w.shape)) for g, w in zip(got, want)]}
    errors = {n: rel_err(g, w) for n, g, w in zip(names, got, want)}
    return {n: e for n, e in errors.items() if not e < TOL}


def compile_and_compare(mutation: str, s: Sizes, seed: int):
    """Compiles the mutated block with verify=False and compares it with eager on two sets of inputs; returns the
    patterns it fused (None where eager itself raises: not a block at all)."""
    fn = block(s, mutation)
    first, fresh = inputs(s, seed), inputs(s, seed + 1)
    try:
        want = [run(fn, first, seed), run(fn, fresh, seed + 1)]
    except (RuntimeError, IndexError):
        return None
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="moe_fuse", options=OPTIONS)
    with collect_reports() as reports:
        got = [run(compiled, first, seed), run(compiled, fresh, seed + 1)]
    torch._dynamo.reset()
    fused = {m["pattern"] for r in reports for m in r.matches}
    for g, w in zip(got, want):
        wrong = differences(g, w)
        assert not wrong, f"{mutation} at {s}: fused {sorted(fused)} with verify=False, and differs from eager: {wrong}"
    return fused


# No shrinking: a failing example names its mutation and sizes already, and each one compiles.
SETTINGS = settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                    database=None, phases=[Phase.explicit, Phase.generate])


def dangerous(mutation: str) -> Sizes:
    """Fixed sizes where ``mutation`` is the dangerous kind."""
    needs = MUTATIONS[mutation].needs
    T, k, E, I = (2 if "T == k" in needs else 4), 2, 4, 4
    H = next((size for need, size in {"S == H": T * k, "H == 2I": 2 * I, "H == I": I, "E == H": E}.items()
              if need in needs), 8)
    return Sizes(T=T, k=k, E=E, H=H, I=I, renorm="no renorm" not in needs, ep="ep" in needs)


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_mutation_is_rejected_or_exact(mutation):
    """The fixed dangerous sizes (where the mutation is known to change the block), then drawn ones."""

    @SETTINGS
    @example(s=dangerous(mutation), seed=0)
    @given(s=sizes_for(mutation), seed=st.integers(0, 2**16))
    def holds(s, seed):
        compile_and_compare(mutation, s, seed)

    holds()


@pytest.mark.parametrize("mutation", [m for m, mut in MUTATIONS.items() if mut.changes])
def test_mutation_changes_the_block(mutation):
    """Each mutation changes what the block computes at its dangerous sizes (else its test above proves nothing)."""
    s = dangerous(mutation)
    args = inputs(s, 0)
    try:
        got = run(block(s, mutation), args, 1)
    except (RuntimeError, IndexError):
        pytest.fail(f"{mutation} raises eagerly at {s}: not a block")
    assert differences(got, run(block(s, "none"), args, 1)), mutation


@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("ep", [False, True])
def test_reference_block_is_fused(renorm, ep):
    """The unmutated block is the pattern, router and experts both fused, with or without the renorm and the
    sentinel masks (else the mutation tests prove nothing)."""
    assert compile_and_compare("none", Sizes(T=5, k=2, E=4, H=8, I=4, renorm=renorm, ep=ep), 0) == {EXPERTS, ROUTER}


@pytest.mark.parametrize("mutation, reason", [
    ("unpermute_reversed", "the un-permutation writes arange(7, -1, -1) into inv, expected arange(0, 8, 1)"),
    ("unpermute_start", "the un-permutation writes arange(-1, 7, 1) into inv, expected arange(0, 8, 1)"),
    ("weights_unsqueeze0", "the column of routing weights has shape [1, 8], expected [8, 1]"),
    ("h_scaled_in_place", "an in-place mul_ writes into h, a tensor of the block: not part of the pattern"),
    ("sentinel_mask_ge0", "sentinel mask is expert_ids_g >= 0, expected expert_ids_g >= 4"),
])
def test_rejection_names_what_was_found(mutation, reason):
    """The two blocks that verify=False fused with wrong gradients (a reversed un-permutation; the routing weights
    unsqueezed along the wrong axis where S == H) and a few more are rejected by the walk, with what it found."""
    s = Sizes(T=4, k=2, E=4, H=8, I=4, renorm=True, ep=mutation.startswith("sentinel"))
    with collect_reports() as reports:
        fused = compile_and_compare(mutation, s, 0)
    assert fused == {ROUTER}
    rejected = [r["reason"] for g in reports for r in g.rejected if r["pattern"] == EXPERTS]
    assert rejected and all(reason in r for r in rejected), rejected


@pytest.mark.parametrize("mutation", ["none", "unpermute_reversed", "unpermute_step", "rows_scaled_in_place"])
def test_symbolic_token_count(mutation):
    """A second token count recompiles the block with a symbolic one (S = 2*s0): the arange's bounds are compared as
    sizes, without guards; the reference block is fused in both graphs, the mutated ones in neither."""
    torch._dynamo.reset()
    compiled = torch.compile(block(Sizes(T=4, k=2, E=4, H=8, I=4, renorm=True), mutation), backend="moe_fuse",
                             options=OPTIONS)
    with collect_reports() as reports:
        for T in (4, 7):
            s = Sizes(T=T, k=2, E=4, H=8, I=4, renorm=True)
            args = inputs(s, T)
            assert not differences(run(compiled, args, 1), run(block(s, mutation), args, 1)), (mutation, T)
    torch._dynamo.reset()
    assert len(reports) == 2
    for report in reports:
        fused = {m["pattern"] for m in report.matches}
        assert fused == ({EXPERTS, ROUTER} if mutation == "none" else {ROUTER}), (report.graph, fused)
