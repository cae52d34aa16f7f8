"""The Gluon kernel modules' launches compiled for sm90 on a machine without a GPU (tests/test_gluon_*.py).

Gluon has no interpreter, so this is what CI can check of them: each launch compiles, fits in shared memory, and
ptxas spills nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

H100_SHARED_BYTES = 227 * 1024  # the most one block may use on sm90

# In a process of its own: once the Triton interpreter has run kernels in this one (other test modules), compiling
# Gluon here fails inside triton's code generator.
_SCRIPT = """
import json, subprocess, sys, tempfile
from triton.backends.nvidia.compiler import get_ptxas
import importlib
m = importlib.import_module("{module}")
report = []
for launch in m.LAUNCHES:
    kernel = m.compile_sm90(*launch)
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


def sm90_report(module: str) -> list[dict]:
    """Each launch of ``<module>.LAUNCHES`` (a dotted module name; bench/ is on the path too) through its
    ``compile_sm90`` and ptxas -v: the launch, its shared bytes, whether the PTX has warpgroup MMAs, setmaxnreg and
    cp.async, and ptxas's report."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "bench"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _SCRIPT.format(module=module)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
