"""Which code a benchmark result came from.

`git describe` alone does not say: the device machine runs over a copy of the working tree whose git
metadata can be stale (every JSON of one session read "997fd95-dirty" whatever the commit). So results
also record `source_sha`, a hash of the moe_fuse package's and bench/'s Python sources as they are on
disk. To find the commit of a result, run this file at candidate commits (clean tree) and compare:

    python3 bench/provenance.py     # prints {"git": ..., "source_sha": ...}
"""

import hashlib
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def source_sha(root: Path = ROOT) -> str:
    """sha256 (first 12 hex digits) over the sorted relative paths and bytes of moe_fuse/**/*.py and bench/*.py."""
    h = hashlib.sha256()
    files = sorted([*root.glob("moe_fuse/**/*.py"), *root.glob("bench/*.py")])
    for path in files:
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def git_describe(root: Path = ROOT) -> str:
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "unknown"


def code_version(root: Path = ROOT) -> dict:
    return {"git": git_describe(root), "source_sha": source_sha(root)}


if __name__ == "__main__":
    print(json.dumps(code_version()))
