"""kernels/gluon_ragged.py on a machine without a GPU.

Gluon has no interpreter, so the kernels' results are checked on the H200 only
(bench/check_gluon_ragged_gpu.py: bitwise equal to ragged_gemm and the SwiGLU / dSwiGLU passes, which
the CPU tests cover). Here: every launch compiles for sm90, fits in shared memory, and ptxas spills
nothing (a spilling epilogue was the first version's problem); and the wrappers refuse what they
cannot run with an error naming the problem.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_fuse.kernels import gluon_ragged

H100_SHARED_BYTES = 227 * 1024  # the most one block may use on sm90

# In a process of its own: once the Triton interpreter has run kernels in this one (other test
# modules), compiling Gluon here fails inside triton's code generator.
_COMPILE_ALL = """
import json, subprocess, sys, tempfile
from triton.backends.nvidia.compiler import get_ptxas
from moe_fuse.kernels import gluon_ragged
report = []
for epi, b_kmajor, block_n in gluon_ragged.LAUNCHES:
    kernel = gluon_ragged.compile_sm90(epi, b_kmajor, block_n)
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        open(d + "/k.ptx", "w").write(ptx)
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", d + "/k.ptx", "-o", d + "/k.cubin"],
                             capture_output=True, text=True, check=True)
    report.append(dict(launch=[epi, b_kmajor, block_n], shared=kernel.metadata.shared, wgmma="wgmma.mma_async" in ptx,
                       setmaxnreg="setmaxnreg" in ptx, ptxas=out.stdout + out.stderr))
print(json.dumps(report))
"""


def test_every_launch_compiles_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _COMPILE_ALL], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
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
