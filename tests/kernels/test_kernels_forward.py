"""The Triton forward kernels of the experts block against the float64 reference.

Runs in the Triton interpreter on CPU tensors when no GPU is present (the
variable is set before anything imports triton in this module; the kernels read
it at call time, so an earlier import of the package elsewhere does no harm).
Shapes stay tiny (H, I <= 96, T <= 64): the interpreter runs each program in
Python. The interpreter rounds fp32 -> bf16 by truncation, so bf16 tolerances
here are looser than on a GPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# The interpreter itself converts 1-element arrays with int(): numpy's warning about it is noise here.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from moe_fuse.dispatch import experts_forward, supports  # noqa: E402
from moe_fuse.kernels import route  # noqa: E402
from moe_fuse.kernels.combine import combine  # noqa: E402
from moe_fuse.kernels.grouped_gemm import GemmConfig, down, gate_up  # noqa: E402
from support.cases import DEVICE, make_case, make_ids, poisoned_buffers, ref64, rel_err  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def run_poisoned(monkeypatch, *args, **kwargs):
    with poisoned_buffers(monkeypatch):
        return experts_forward(*args, **kwargs)


# --------------------------------------------------------------------------- routing metadata


@pytest.mark.parametrize(
    "T,k,E,mode",
    [
        (1, 1, 4, "uniform"),
        (37, 3, 5, "uniform"),
        (64, 4, 6, "skewed"),  # S = 256: several counting blocks, empty experts
        (50, 6, 160, "uniform"),  # E > 128: E_P2 = 256
        (40, 2, 7, "one"),
        (45, 4, 6, "sentinels"),
    ],
)
def test_routing_metadata(T, k, E, mode):
    gen = torch.Generator().manual_seed(T * 1000 + E)
    ids = make_ids(T, k, E, mode, gen).to(DEVICE)
    r = route(ids, E)
    flat = ids.reshape(-1).cpu()
    order, counts, offsets = r.order.cpu().long(), r.counts.cpu().long(), r.offsets.cpu().long()
    routed = int((flat < E).sum())
    assert torch.equal(counts, torch.bincount(flat[flat < E], minlength=E))
    assert torch.equal(offsets, torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
    assert offsets[-1] == routed
    # A permutation of the rows, grouped by expert, each group in increasing row order (stable).
    assert torch.equal(order.sort().values, torch.arange(flat.numel()))
    assert torch.equal(order[:routed], torch.argsort(flat, stable=True)[:routed])
    for e in range(E):
        seg = order[offsets[e] : offsets[e + 1]]
        assert bool((flat[seg] == e).all())
        assert bool((seg[1:] > seg[:-1]).all())
    # Sentinel rows (ids >= E) last, in row order.
    assert torch.equal(order[routed:], torch.nonzero(flat >= E).flatten())
    # pos is the inverse permutation; token the token of each sorted position.
    assert torch.equal(r.pos.cpu().long()[order], torch.arange(flat.numel()))
    assert torch.equal(r.token.cpu().long(), order // k)


def test_routing_buffer_round_trip_and_errors():
    """A forward keeps Routing.buf; from_buffer gives back the same views. A wrong buffer is named."""
    from moe_fuse.kernels.routing import buffer_size, from_buffer

    ids = make_ids(10, 3, 4, "skewed", torch.Generator().manual_seed(2)).to(DEVICE)
    r = route(ids, 4)
    assert r.buf.numel() == buffer_size(30, 4) and r.buf.dtype == torch.int32
    again = from_buffer(r.buf.clone(), 30, 4)
    for name, a, b in zip(r._fields, r, again):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match=r"saved routing must be a contiguous int32 vector of 100 elements \(S=30, E=4\)"):
        from_buffer(r.buf[:-1], 30, 4)
    with pytest.raises(ValueError, match="got torch.int64"):
        from_buffer(r.buf.long(), 30, 4)


def test_routing_int32_ids():
    gen = torch.Generator().manual_seed(3)
    ids = make_ids(20, 3, 9, "uniform", gen)
    r = route(ids.to(torch.int32).to(DEVICE), 9)
    assert torch.equal(r.order.cpu().long(), torch.argsort(ids.reshape(-1), stable=True))


# --------------------------------------------------------------------------- forward

FORWARD_CASES = {
    # name: (T, k, E, H, I, dtype, mode, extra)
    "uneven_bf16": (48, 4, 6, 40, 24, torch.bfloat16, "skewed", {}),
    "uneven_fp16": (48, 4, 6, 40, 24, torch.float16, "skewed", {}),
    "uneven_fp32": (48, 4, 6, 40, 24, torch.float32, "skewed", {}),
    "empty_experts": (30, 2, 8, 48, 40, torch.float16, "two", {}),
    "all_on_one_expert": (40, 2, 5, 32, 48, torch.float32, "one", {}),  # 80 rows: several M-tiles
    "single_token": (1, 2, 4, 40, 24, torch.bfloat16, "uniform", {}),
    "k1": (33, 1, 3, 40, 24, torch.float32, "uniform", {}),
    "k_equals_E": (12, 5, 5, 24, 40, torch.float16, "uniform", {}),
    "even_blocks": (16, 2, 4, 64, 32, torch.bfloat16, "uniform", {}),  # H, I multiples of the blocks
    "odd_sizes_E7": (21, 3, 7, 72, 56, torch.float32, "uniform", {}),  # tails in N and K of both GEMMs
    "x_fp32_weights_bf16": (24, 2, 4, 40, 24, torch.float32, "uniform", {"w_dtype": torch.bfloat16}),
    "routing_fp32_x_bf16": (24, 2, 4, 40, 24, torch.bfloat16, "uniform", {"r_dtype": torch.float32}),
    "routing_bf16_x_fp16": (24, 2, 4, 40, 24, torch.float16, "uniform", {"r_dtype": torch.bfloat16}),
    "ep_sentinels": (30, 3, 5, 40, 24, torch.float32, "sentinels", {}),
}


@pytest.mark.parametrize("name", list(FORWARD_CASES))
def test_forward_matches_reference(name, monkeypatch):
    T, k, E, H, I, dtype, mode, extra = FORWARD_CASES[name]
    args = make_case(T, k, E, H, I, dtype, mode, seed=len(name), **extra)
    ref = ref64(*args)
    y = run_poisoned(monkeypatch, *args)
    assert y.shape == (T, H) and y.dtype == args[0].dtype
    assert bool(torch.isfinite(y).all()), "some output element was never written"
    w_dtype = args[3].dtype
    tol = max(TOL[dtype], TOL[w_dtype], TOL[args[2].dtype])
    assert rel_err(y.cpu(), ref) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tma_descriptor_path(dtype, monkeypatch):
    """The Hopper path (weights and the down GEMM's A through tensor descriptors), run by the interpreter.

    I = 24 < BLOCK_N: gate tiles run into the up rows and the last expert's up tile past the tensor's end.
    """
    args = make_case(26, 3, 5, 40, 24, dtype, "skewed", seed=5)
    x, ids, weights, w_gate_up, w_down = args
    cfg = GemmConfig(16, 32, 32, 1, 4, 1, use_tma=True)

    def staged():
        routing = route(ids, 5)
        a, _ = gate_up(x, routing, w_gate_up, 3, config=cfg)
        return combine(down(a, routing, weights, w_down, dtype, config=cfg), ids, 5, dtype)

    with poisoned_buffers(monkeypatch):
        y = staged()
    assert bool(torch.isfinite(y).all())
    assert rel_err(y.cpu(), ref64(*args)) < TOL[dtype]


def test_forward_non_contiguous(monkeypatch):
    x, ids, weights, w_gate_up, w_down = make_case(20, 3, 6, 40, 24, torch.float32, "skewed", seed=7)
    # x: every other column of a wider tensor; ids, weights: transposed storage;
    # weights of the experts: transposed views of [E, H, 2I] and [E, I, H] storage.
    x_nc = torch.empty(20, 80, device=DEVICE)[:, ::2]
    x_nc.copy_(x)
    ids_nc = ids.t().contiguous().t()
    weights_nc = weights.t().contiguous().t()
    wgu_nc = w_gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    wd_nc = w_down.transpose(1, 2).contiguous().transpose(1, 2)
    assert not any(t.is_contiguous() for t in (x_nc, ids_nc, weights_nc, wgu_nc, wd_nc))
    y = run_poisoned(monkeypatch, x_nc, ids_nc, weights_nc, wgu_nc, wd_nc)
    assert rel_err(y.cpu(), ref64(x, ids, weights, w_gate_up, w_down)) < TOL[torch.float32]


def test_forward_is_deterministic_and_saves_h():
    args = make_case(24, 3, 5, 40, 24, torch.bfloat16, "skewed", seed=11)
    x, ids, weights, w_gate_up, w_down = args
    y1 = experts_forward(*args)
    y2, h, routing = experts_forward(*args, save_h=True)
    assert torch.equal(y1, experts_forward(*args)) and torch.equal(y2, experts_forward(*args, save_h=True)[0])
    from moe_fuse.dispatch import uses_grouped_mm

    if uses_grouped_mm(x, ids, w_gate_up, w_down):  # sm90 bf16: saving h takes the grouped_mm path (its own bits)
        assert rel_err(y2.cpu(), y1.cpu().double()) < TOL[torch.bfloat16]
    else:  # one kernel path: saving h changes nothing else
        assert torch.equal(y1, y2)
    # h[p] = W_gate_up[e] x[token] for the row order[p], before the activation.
    order = routing.order.cpu().long()
    k = ids.shape[1]
    e = ids.reshape(-1).cpu()[order]
    xs = x.cpu().double()[order // k]
    h_ref = torch.einsum("sh,snh->sn", xs, w_gate_up.cpu().double()[e])
    assert h.shape == (order.numel(), 2 * w_gate_up.shape[1] // 2)
    assert rel_err(h.cpu(), h_ref) < TOL[torch.bfloat16]


def test_supports():
    args = make_case(4, 2, 3, 16, 16, torch.bfloat16)
    assert supports(*args)
    x, ids, weights, w_gate_up, w_down = args
    assert not supports(x.double(), ids, weights, w_gate_up, w_down)
    assert not supports(x, ids, weights, w_gate_up, w_down.half())  # GEMM dtypes must agree
    assert not supports(x, ids.float(), weights, w_gate_up, w_down)
    assert not supports(x, ids[:, :1], weights, w_gate_up, w_down)


def test_empty_batch():
    x, ids, weights, w_gate_up, w_down = make_case(3, 2, 4, 16, 16, torch.float32)
    y = experts_forward(x[:0], ids[:0], weights[:0], w_gate_up, w_down)
    assert y.shape == (0, 16)


def test_package_import_leaves_triton_alone():
    """Importing moe_fuse.kernels must not import triton: triton fixes interpreter-or-compiler at its import."""
    import subprocess
    import sys

    code = "import sys, moe_fuse.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
