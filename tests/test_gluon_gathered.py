"""kernels/gluon_gathered.py on a machine without a GPU.

Gluon has no interpreter, so the kernel's results are checked on the H200 only (bench/probe_gluon_rows_coop_gpu.py:
bitwise against CUTLASS on the sorted copy, and the copy it writes against expand_rows). Here: every launch compiles
for sm90, fits in shared memory, and ptxas spills nothing; the wrapper refuses what it cannot run, naming the
problem; and grouped_mm_path's GATHERED_ROWS wiring (tests/test_grouped_mm_path.py) takes it where it applies.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_fuse.kernels import gluon_gathered

H100_SHARED_BYTES = 227 * 1024  # the most one block may use on sm90

# In a process of its own, as tests/test_gluon_ragged.py: Gluon compiles fail once the interpreter has run here.
_COMPILE_ALL = """
import json, subprocess, sys, tempfile
from triton.backends.nvidia.compiler import get_ptxas
from moe_fuse.kernels import gluon_gathered
report = []
for launch in gluon_gathered.LAUNCHES:
    kernel = gluon_gathered.compile_sm90(*launch)
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        open(d + "/k.ptx", "w").write(ptx)
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", d + "/k.ptx", "-o", d + "/k.cubin"],
                             capture_output=True, text=True, check=True)
    report.append(dict(launch=list(launch), shared=kernel.metadata.shared, wgmma="wgmma.mma_async" in ptx,
                       setmaxnreg="setmaxnreg" in ptx, cp_async=any(op in ptx for op in ("cp.async.ca", "cp.async.cg")),
                       ptxas=out.stdout + out.stderr))
print(json.dumps(report))
"""


def test_every_launch_compiles_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _COMPILE_ALL], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
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
