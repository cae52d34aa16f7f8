"""kernels/gluon_ragged.py on a machine without a GPU.

Gluon has no interpreter, so the kernels' results are checked on the H200 only
(bench/check_gluon_ragged_gpu.py: bitwise equal to ragged_gemm and the SwiGLU / dSwiGLU passes, which
the CPU tests cover). Here: every launch compiles for sm90, fits in shared memory, and ptxas spills
nothing (a spilling epilogue was the first version's problem); and the wrappers refuse what they
cannot run with an error naming the problem.
"""

import pytest
import torch

from gluon_compile import H100_SHARED_BYTES, sm90_report
from moe_fuse.kernels import gluon_ragged


def test_every_launch_compiles_for_sm90_without_spills():
    report = sm90_report("moe_fuse.kernels.gluon_ragged")
    assert [r["launch"] for r in report] == [list(launch) for launch in gluon_ragged.LAUNCHES]
    for r in report:
        assert r["shared"] <= H100_SHARED_BYTES, r
        assert r["wgmma"] and r["setmaxnreg"], r  # warpgroup MMAs; partitions with their own register budgets
        assert "0 bytes spill stores, 0 bytes spill loads" in r["ptxas"], r


def test_cpu_operands_are_refused_by_name():
    a = torch.randn(256, 64, dtype=torch.bfloat16)
    b = torch.randn(2, 128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"gluon_ragged.ragged_gemm: needs Gluon and contiguous bf16 CUDA operands"):
        gluon_ragged.ragged_gemm(a, b, torch.zeros(7, dtype=torch.int32), b_kmajor=True)
