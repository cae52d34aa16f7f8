"""bench/gluon_gathered.py (the gathered row GEMMs the probes run) on a machine without a GPU.

Gluon has no interpreter, so the kernel's results are checked on the H200 only (bench/probe_gluon_rows_coop_gpu.py:
bitwise against CUTLASS on the sorted copy, and the copy it writes against expand_rows). Here: every launch compiles
for sm90, fits in shared memory, and ptxas spills nothing; and the wrapper refuses what it cannot run, naming the
problem.
"""

import sys
from pathlib import Path

import pytest
import torch

from gluon_compile import H100_SHARED_BYTES, sm90_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gluon_gathered  # noqa: E402


def test_every_launch_compiles_for_sm90_without_spills():
    report = sm90_report("gluon_gathered")
    assert [tuple(r["launch"]) for r in report] == list(gluon_gathered.LAUNCHES)
    for r in report:
        assert r["shared"] <= H100_SHARED_BYTES, r
        assert r["wgmma"] and r["setmaxnreg"], r  # warpgroup MMAs; partitions with their own register budgets
        assert r["cp_async"] == r["launch"][0], r  # the gathering launches load A through cp.async, the others not
        assert "0 bytes spill stores, 0 bytes spill loads" in r["ptxas"], r


def test_refused_by_name():
    a = torch.randn(256, 64, dtype=torch.bfloat16)
    w = torch.randn(2, 256, 64, dtype=torch.bfloat16)
    tiles = torch.zeros(7, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"gluon_gathered.rows_gemm: needs Gluon and contiguous bf16 CUDA operands"):
        gluon_gathered.rows_gemm(a, w, tiles, 256)


@pytest.mark.parametrize("N, K, ok", [(256, 64, True), (768, 2048, True), (1536, 2048, True), (128, 64, False),
                                      (256, 96, False)])
def test_suits(N, K, ok):
    assert gluon_gathered.suits(N, K) is ok
