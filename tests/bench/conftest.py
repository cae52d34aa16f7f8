"""The benchmark scripts of bench/ on their --cpu-smoke runs: tiny fp32 shapes on the CPU, Inductor replaced by
aot_eager. They check that each script runs and writes what it says, not the speed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # `import common`, `import layer`, ... in process


class Run:
    def __init__(self, proc, out: Path, bench: str):
        self.proc, self.out, self.bench = proc, out, bench
        self.stdout = proc.stdout

    def json(self) -> dict:
        return json.loads((self.out / f"{self.bench}_cpu.json").read_text())

    def md(self) -> str:
        return (self.out / f"{self.bench}_cpu.md").read_text()


@pytest.fixture(scope="session")
def run_bench(tmp_path_factory):
    """run_bench("layer.py", *args): the script's --cpu-smoke run into a fresh folder; it must exit 0."""
    def run(script, *args, launcher=(sys.executable,), check=True):
        out = tmp_path_factory.mktemp(Path(script).stem)
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        proc = subprocess.run([*launcher, str(ROOT / "bench" / script), "--cpu-smoke", "--out", str(out), *args],
                              capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
        if check:
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return Run(proc, out, Path(script).stem)

    return run


@pytest.fixture(scope="session")
def check_provenance():
    """check_provenance(meta, "layer.py"): the result names the code, the machine and the command it came from."""
    import common

    def check(meta: dict, script: str):
        assert meta["source_sha"] == common.source_sha() and meta["commit"]
        assert meta["gpu"] and meta["torch"] and meta["triton"] and meta["transformers"]
        assert f"bench/{script} --cpu-smoke" in meta["command"]
        assert meta["moe_fuse_config"]["grouped_mm"] is True

    return check
