"""bench/memory_peak.py: the blocks live at the highest point of an allocator trace, grouped by who allocated them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from memory_peak import live_at_peak, summary  # noqa: E402

MiB = 2**20


def ev(action, addr, size, fn="model.py", line=1):
    frames = [{"filename": "/x/site-packages/torch/cuda/alloc.py", "line": 9, "name": "empty"},
              {"filename": f"/repo/{fn}", "line": line, "name": "forward"}]
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def test_peak_is_the_highest_live_set_not_the_last():
    events = [
        ev("alloc", 1, 4 * MiB, line=10),
        ev("alloc", 2, 8 * MiB, line=20),
        ev("free_requested", 1, 4 * MiB),
        ev("free_completed", 1, 4 * MiB),
        ev("alloc", 3, 2 * MiB, line=30),  # 10 MiB live now: below the 12 MiB peak
        ev("free_requested", 99, 64 * MiB),  # allocated before the trace: not counted
        ev("alloc", 4, 1 * MiB, line=40),
    ]
    peak, held = live_at_peak(events)
    assert peak == 12 * MiB
    assert sorted(e["addr"] for e in held) == [1, 2]


def test_summary_groups_by_the_first_frame_outside_torch():
    events = [ev("alloc", 1, 3 * MiB, "a.py", 5), ev("alloc", 2, 3 * MiB, "a.py", 5),
              ev("alloc", 3, 1 * MiB, "b.py", 7)]
    lines = summary(events)
    assert lines[0] == "peak 7 MiB over the start, 3 blocks live"
    assert lines[1].split() == ["6.0", "MiB", "x2", "repo/a.py:5", "forward"]
    assert lines[2].split() == ["1.0", "MiB", "x1", "repo/b.py:7", "forward"]
