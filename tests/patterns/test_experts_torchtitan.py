"""TorchTitan's MoE (torchtitan 0.3.0, ``torchtitan.models.common.moe.MoE`` as its Qwen3 builds it):
the experts (w1/w3/w2 bf16 grouped GEMMs, scatter-add combine) fused into moe_fuse.experts; parity of
the output and of every gradient with eager; near misses left alone with a reason."""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan.models.common.moe")

from support.models import rel_err  # noqa: E402

E, K, D, I = 4, 2, 32, 16


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        # TorchTitan's router asks for a float32 autocast, which CPU autocast does not support.
        warnings.filterwarnings("ignore", message=".*CPU autocast.*")
        warnings.filterwarnings("ignore", message=".*CPU Autocast.*")
        yield
    torch._dynamo.reset()


def qwen3_moe_layer(dtype=torch.float32, shared_experts=False, seed=0):
    """The MoE layer of TorchTitan's Qwen3 (softmax router, route_norm, load-balancing bias), tiny."""
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.common.config_utils import make_ffn_config
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers

    (layer,) = _build_qwen3_moe_layers(
        n_layers=1, dim=D, n_heads=4, n_kv_heads=2, head_dim=8, moe_hidden_dim=I, num_experts=E, top_k=K,
        attn_backend="flex", moe_comm_backend="standard", rope=CosSinRoPE.Config(dim=8, max_seq_len=64, theta=1e6),
    )
    config = layer.moe
    if shared_experts:
        init = {"weight": torch.nn.init.normal_}
        config.shared_experts = make_ffn_config(dim=D, hidden_dim=I, w1_param_init=init, w2w3_param_init=init)
    moe = config.build()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        if moe.expert_bias_E is not None:  # the load-balancing bias steers the selection only
            moe.expert_bias_E.copy_(torch.randn(E, generator=gen) * 0.05)
    return moe.to(dtype).train()


def step(module, x):
    """Output and every gradient (input and parameters) of one backward with a fixed cotangent."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = module(x)
    cot = torch.linspace(-1, 1, y.numel()).view(y.shape).to(y.dtype)
    (y * cot).sum().backward()
    grads = {n.removeprefix("_orig_mod."): p.grad for n, p in module.named_parameters()}
    return y.detach(), x.grad, grads


def reports(debug_dir):
    return [json.loads(p.read_text()) for p in sorted(debug_dir.glob("graph_*/report.json"))]


def compile_moe_fuse(module, debug_dir, inner="aot_eager", **kwargs):
    options = {"moe_fuse.inner": inner, "moe_fuse.debug_dir": str(debug_dir)}
    return torch.compile(module, backend="moe_fuse", options=options, **kwargs)


# Eager TorchTitan runs the backward GEMMs in bf16; moe_fuse's backward accumulates in fp32. The forward
# is bitwise equal (same casts, same GEMM dtype); gradients differ by bf16 rounding (measured ~5e-3).
GRAD_TOL = 2e-2


def assert_parity(eager, fused, fwd_tol=1e-6):
    assert rel_err(fused[0], eager[0]) <= fwd_tol
    assert rel_err(fused[1], eager[1]) < GRAD_TOL
    assert eager[2].keys() == fused[2].keys()
    for name in eager[2]:
        assert fused[2][name] is not None, name
        assert rel_err(fused[2][name], eager[2][name]) < GRAD_TOL, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared_experts", [False, True])
def test_qwen3_moe_layer_fused_with_parity(dtype, shared_experts, tmp_path):
    moe = qwen3_moe_layer(dtype, shared_experts)
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    counts_before = moe.tokens_per_expert_E.clone()
    eager = step(moe, x)
    counted_eagerly = moe.tokens_per_expert_E - counts_before
    fused = step(compile_moe_fuse(moe, tmp_path), x)
    assert_parity(eager, fused)
    # The per-expert token counts the block keeps for load balancing are still accumulated.
    assert torch.equal(moe.tokens_per_expert_E - counts_before, 2 * counted_eagerly)

    (report,) = reports(tmp_path)
    (m,) = [m for m in report["matches"] if m["pattern"] == "torchtitan_experts"]
    assert (m["num_experts"], m["top_k"], m["hidden"], m["intermediate"]) == (E, K, D, I)
    assert m["verified"] and m["layout"] == "w1_w3_w2" and m["dtype"] == str(dtype).removeprefix("torch.")
    assert "routed_experts.inner_experts" in m["where"]
    assert any("concatenated" in note for note in m["notes"])
    assert any("GEMMs in bfloat16" in note for note in m["notes"]) is (dtype == torch.float32)
    assert [r for r in report["rejected"] if r["pattern"] == "torchtitan_experts"] == []

    folder = tmp_path / report["graph"]
    before, after = (folder / "before.py").read_text(), (folder / "after.py").read_text()
    assert before.count("= torch._grouped_mm(") == 3 and "= torch.ops.torchtitan.deterministic_scatter_add" in before
    assert after.count("torch.ops.moe_fuse.experts.default") == 1
    assert "= torch._grouped_mm(" not in after and "= torch.ops.torchtitan.deterministic_scatter_add" not in after
    assert "tokens_per_expert_e_.add_" in after  # the load-balancing count stays


def test_dynamic_token_count(tmp_path):
    moe = qwen3_moe_layer()
    compiled = compile_moe_fuse(moe, tmp_path, dynamic=True)
    for seq in (5, 7):
        x = torch.randn(2, seq, D, generator=torch.Generator().manual_seed(seq))
        assert_parity(step(moe, x), step(compiled, x))
    for report in reports(tmp_path):
        assert [m["pattern"] for m in report["matches"]] == ["torchtitan_experts"]


def test_activation_checkpointing(tmp_path):
    """TorchTitan wraps blocks in non-reentrant activation checkpointing: fused inside the body."""

    class Checkpointed(torch.nn.Module):
        def __init__(self, moe):
            super().__init__()
            self.moe = moe

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.moe, x, use_reentrant=False)

    module = Checkpointed(qwen3_moe_layer())
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1))
    assert_parity(step(module, x), step(compile_moe_fuse(module, tmp_path), x))
    matches = [m for r in reports(tmp_path) for m in r["matches"]]
    assert [m["pattern"] for m in matches] == ["torchtitan_experts"]
    assert matches[0]["where"].startswith("wrap_body")


def test_inductor(tmp_path):
    moe = qwen3_moe_layer()
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1))
    assert_parity(step(moe, x), step(compile_moe_fuse(moe, tmp_path, inner="inductor"), x), fwd_tol=1e-5)
    (report,) = reports(tmp_path)
    assert [m["pattern"] for m in report["matches"]] == ["torchtitan_experts"]


def test_explain_shows_the_match_and_its_notes():
    import moe_fuse

    moe = qwen3_moe_layer()
    explanation = moe_fuse.explain(moe, torch.randn(2, 5, D))
    assert [m["pattern"] for m in explanation.matches] == ["torchtitan_experts"]
    text = str(explanation)
    assert "fused    torchtitan_experts" in text and "note: gate (w1) and up (w3) weights concatenated" in text


# --------------------------------------------------------------------------- hand-written variants


class TitanStyleExperts(torch.nn.Module):
    """TorchTitan's routed-experts computation written out by hand (routing given), with deviations.

    Same op sequence as LocalTokenDispatcher.dispatch/combine + GroupedExperts.forward; the variants
    are earlier TorchTitan spellings (histc counts, a plain scatter_add) and near misses.
    """

    def __init__(self, variant="exact"):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.variant = variant
        self.w1 = torch.nn.Parameter(torch.randn(E, I, D, generator=gen) * 0.2)
        self.w2 = torch.nn.Parameter(torch.randn(E, D, I, generator=gen) * 0.2)
        self.w3 = torch.nn.Parameter(torch.randn(E, I, D, generator=gen) * 0.2)

    def forward(self, x, ids, scores):
        T = x.shape[0]
        if self.variant in ("histc", "histc_wide"):  # the latter: bins 1.5 wide, two experts in the first
            counts = torch.histc(ids.view(-1).float(), bins=E, min=0, max=E if self.variant == "histc" else E + 2)
        else:
            counts = torch.zeros(T, E, dtype=torch.bool).scatter_(-1, ids, True).sum(dim=0)
        if self.variant == "shifted_counts":  # offsets that do not belong to these ids
            counts = counts.roll(1)
        perm = torch.argsort(ids.view(-1), stable=True)
        picked = scores.view(-1)[perm]
        tok = perm // K
        xs = x[tok]
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        act = F.gelu if self.variant == "gelu" else F.silu
        h = act(torch._grouped_mm(xs.bfloat16(), self.w1.bfloat16().transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(xs.bfloat16(), self.w3.bfloat16().transpose(-2, -1), offs=offs)
        ys = torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offs).type_as(xs)
        ys = (ys.to(torch.float32) * picked.reshape(-1, 1)).to(ys.dtype)
        index = tok.reshape(-1, 1).expand(-1, D)
        if self.variant in ("histc", "scatter_add_method"):
            return torch.zeros_like(x).scatter_add(0, index, ys)
        from torchtitan.ops.scatter_add import deterministic_scatter_add

        return deterministic_scatter_add(torch.zeros_like(x), index, ys)


def run(variant, tmp_path):
    module = TitanStyleExperts(variant)
    gen = torch.Generator().manual_seed(3)
    T = 10
    x = torch.randn(T, D, generator=gen)
    ids = torch.rand(T, E, generator=gen).argsort(dim=-1)[:, :K].contiguous()
    scores = torch.rand(T, K, generator=gen) + 0.1
    want = module(x, ids, scores)
    options = {"moe_fuse.inner": "eager", "moe_fuse.debug_dir": str(tmp_path)}
    got = torch.compile(module, backend="moe_fuse", options=options)(x, ids, scores)
    (report,) = reports(tmp_path)
    return want, got, report


@pytest.mark.parametrize("variant", ["exact", "histc", "scatter_add_method"])
def test_hand_written_spellings_are_fused(variant, tmp_path):
    want, got, report = run(variant, tmp_path)
    (m,) = report["matches"]
    assert m["pattern"] == "torchtitan_experts" and report["rejected"] == []
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("variant, reason", [
    ("shifted_counts", "expert counts from roll, expected a histc of the ids or the sum of their one-hot routing map"),
    ("histc_wide", f"expert counts histc(bins={E}, min=0, max={E + 2}), expected bins={E}, min=0, max={E}"),
])
def test_counts_that_do_not_fit_the_ids_are_rejected(variant, reason, tmp_path):
    # The walk reads the counts (a histc or a one-hot routing map of the same ids): rejected before verification.
    want, got, report = run(variant, tmp_path)
    assert report["matches"] == []
    (rejection,) = report["rejected"]
    assert rejection["pattern"] == "torchtitan_experts"
    assert rejection["reason"] == reason
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_fused_op_that_disagrees_is_rejected_by_verification(tmp_path, monkeypatch):
    from moe_fuse.patterns import experts_torchtitan

    match = experts_torchtitan.match

    def match_with_a_wrong_op(node):  # the op's output doubled: what verification is for
        cand = match(node)
        op = cand.op
        cand.op = lambda *args, **kwargs: op(*args, **kwargs) * 2
        return cand

    monkeypatch.setattr(experts_torchtitan, "match", match_with_a_wrong_op)
    want, got, report = run("exact", tmp_path)
    assert report["matches"] == []
    (rejection,) = report["rejected"]
    assert rejection["pattern"] == "torchtitan_experts" and "differs" in rejection["reason"]
    assert any("concatenated" in note for note in rejection["notes"])  # the candidate's notes come along
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_structural_difference_is_rejected_with_its_reason(tmp_path):
    want, got, report = run("gelu", tmp_path)
    assert report["matches"] == []
    (rejection,) = report["rejected"]
    assert rejection["pattern"] == "torchtitan_experts" and "silu" in rejection["reason"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
