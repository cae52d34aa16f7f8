"""kernels/ragged_gemm.py: the tile map and the row-ragged GEMM against a float64 reference.

On CPU the kernels run in the Triton interpreter with 16-row tiles, so counts of 0, 1, 15, 16, 17 and
33 rows cover empty experts, partial, whole and several tiles; rows past offsets[E] (expert-parallel
sentinels) must stay unwritten.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from moe_fuse.kernels.ragged_gemm import RaggedConfig, block_m, ragged_gemm, tile_map  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def offsets_of(counts):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def test_tile_map_lists_every_experts_tiles():
    bm = block_m()
    counts = [0, 1, bm - 1, bm, bm + 1, 0, 2 * bm + 1]
    offsets = offsets_of(counts)
    rows = int(offsets[-1]) + 5  # five sentinel rows
    tiles = tile_map(offsets, rows).cpu()
    want = []
    for e, n in enumerate(counts):
        lo = int(offsets[e])
        want += [(e, lo + i * bm, lo + n) for i in range(-(-n // bm))]
    assert tiles.numel() == 1 + 3 * (rows // bm + len(counts))
    assert int(tiles[0]) == len(want)
    assert tiles[1 : 1 + 3 * len(want)].view(-1, 3).tolist() == [list(w) for w in want]


def test_tile_map_rejects_bad_offsets():
    with pytest.raises(ValueError, match="offsets must be int32"):
        tile_map(torch.tensor([0, 4], dtype=torch.int64, device=DEVICE), 4)


@pytest.mark.parametrize("b_kmajor", [True, False], ids=["kmajor", "kn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (40, 48): neither a multiple of the blocks (pointer loads); (64, 256): on a GPU, the TMA path (bf16)
@pytest.mark.parametrize("K,N", [(40, 48), (64, 256)], ids=["ragged_kn", "tma_kn"])
def test_ragged_gemm_matches_float64(b_kmajor, dtype, K, N):
    gen = torch.Generator().manual_seed(1)
    bm = block_m()
    counts = [bm + 1, 0, 1, bm, 2 * bm + 1, bm - 1]
    E = len(counts)
    offsets = offsets_of(counts)
    routed = int(offsets[-1])
    R = routed + 3  # sentinel rows
    a = torch.randn(R, K, generator=gen).to(DEVICE, dtype)
    b = torch.randn(E, *((N, K) if b_kmajor else (K, N)), generator=gen).to(DEVICE, dtype)
    out = ragged_gemm(a, b, tile_map(offsets, R), b_kmajor=b_kmajor)
    assert out.shape == (R, N) and out.dtype == dtype
    a64, b64 = a.double().cpu(), b.double().cpu()
    want = torch.empty(routed, N, dtype=torch.float64)
    for e in range(E):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        w = b64[e].t() if b_kmajor else b64[e]
        want[lo:hi] = a64[lo:hi] @ w
    got = out[:routed].double().cpu()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((got - want).abs().max() / want.abs().max()).item() < tol


def test_ragged_gemm_takes_another_launch_setting():
    # benchmarks pass their own setting; the tile map must be built for its block_m
    cfg = RaggedConfig(2 * block_m(), 16, 16, 4, 1)
    gen = torch.Generator().manual_seed(3)
    counts = [cfg.block_m + 3, 0, 5]
    offsets = offsets_of(counts)
    R = int(offsets[-1])
    a = torch.randn(R, 32, generator=gen).to(DEVICE)
    b = torch.randn(len(counts), 32, 24, generator=gen).to(DEVICE)
    tiles = tile_map(offsets, R, config=cfg)
    assert int(tiles[0]) == 3  # 2 + 0 + 1 tiles of 2 * block_m() rows
    got = ragged_gemm(a, b, tiles, b_kmajor=False, config=cfg).double().cpu()
    want = torch.cat([a[lo:hi].double().cpu() @ b[e].double().cpu()
                      for e, (lo, hi) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist()))])
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    with pytest.raises(ValueError, match="is not tile_map"):
        ragged_gemm(a, b, tile_map(offsets, R), b_kmajor=False, config=cfg)


def test_ragged_gemm_takes_strided_weights():
    """A transposed view of the weights (no copy made) gives the same product as the contiguous tensor."""
    bm = block_m()
    offsets = offsets_of([bm + 2, 3])
    R = int(offsets[-1])
    a = torch.randn(R, 24, device=DEVICE)
    w = torch.randn(2, 24, 40, device=DEVICE)  # [E, K, N]
    tiles = tile_map(offsets, R)
    want = ragged_gemm(a, w, tiles, b_kmajor=False)
    got = ragged_gemm(a, w.transpose(1, 2).contiguous().transpose(1, 2), tiles, b_kmajor=False)
    torch.testing.assert_close(got, want)


def test_ragged_gemm_leaves_rows_outside_every_tile():
    bm = block_m()
    offsets = offsets_of([bm + 3, 2])
    routed = int(offsets[-1])
    R = routed + 4
    a = torch.randn(R, 32, device=DEVICE)
    b = torch.randn(2, 32, 32, device=DEVICE)
    out = torch.full((R, 32), float("nan"), device=DEVICE)
    assert ragged_gemm(a, b, tile_map(offsets, R), b_kmajor=False, out=out) is out
    assert bool(torch.isfinite(out[:routed]).all())
    assert bool(torch.isnan(out[routed:]).all())


def test_ragged_gemm_errors_name_the_problem():
    offsets = offsets_of([4])
    a = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="a must be 2-D and b 3-D"):
        ragged_gemm(a, torch.randn(8, 8, device=DEVICE), tile_map(offsets, 4), b_kmajor=False)
    with pytest.raises(ValueError, match=r"need a \[R, K\]"):
        ragged_gemm(a, torch.randn(1, 6, 8, device=DEVICE), tile_map(offsets, 4), b_kmajor=False)
    with pytest.raises(ValueError, match="is not tile_map"):
        # a map for 1024 rows has more tile slots than one for 4, whatever the block height
        ragged_gemm(a, torch.randn(1, 8, 8, device=DEVICE), tile_map(offsets, 1024), b_kmajor=False)
    with pytest.raises(ValueError, match="out must be"):
        ragged_gemm(a, torch.randn(1, 8, 8, device=DEVICE), tile_map(offsets, 4), b_kmajor=False,
                    out=torch.empty(4, 7, device=DEVICE))
