"""bench/memory_peak.py: the blocks live at the highest point of an allocator trace, grouped by who allocated them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from memory_peak import detail, live_at_peak, summary  # noqa: E402

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


def test_detail_lists_blocks_with_the_generated_line_and_its_graph_nodes(tmp_path):
    code = tmp_path / "cgen.py"  # the shape of an Inductor output file
    code.write_text("def call(args):\n"
                    "    # Topologically Sorted Source Nodes: [mm_2], Original ATen: [aten.mm]\n"
                    "    extern_kernels.mm(a, b, out=buf6)\n"
                    "    buf7 = empty_strided_cuda((65536, 4096), (4096, 1), torch.bfloat16)\n"
                    "    # Topologically Sorted Source Nodes: [mm_3], Original ATen: [aten.mm]\n"
                    "    extern_kernels.mm(a, b, out=buf7)\n"
                    "    # Topologically Sorted Source Nodes: [sdpa_backward], Original ATen: [aten.sdpa_backward]\n"
                    "    buf8 = torch.ops.aten.sdpa_backward.default(buf7)\n")
    frame = lambda line: [{"filename": "/x/site-packages/torch/cuda/alloc.py", "line": 9, "name": "empty"},
                          {"filename": str(code), "line": line, "name": "call"}]
    events = [{"action": "alloc", "addr": 1, "size": 512 * MiB, "frames": frame(4)},
              {"action": "alloc", "addr": 3, "size": 64 * MiB, "frames": frame(8)},
              ev("alloc", 2, 2 * MiB, "gone.py", 4)]  # its file is not on disk: the site only
    lines = detail(events)
    assert lines[0].split() == ["512.0", "MiB", f"{tmp_path.name}/cgen.py:4", "call"]
    assert lines[1].strip() == "buf7 = empty_strided_cuda((65536, 4096), (4096, 1), torch.bfloat16)"
    assert lines[2].strip() == "# Topologically Sorted Source Nodes: [mm_3], Original ATen: [aten.mm]"  # the next
    assert lines[3].split() == ["64.0", "MiB", f"{tmp_path.name}/cgen.py:8", "call"]
    assert lines[5].strip().startswith("# Topologically Sorted Source Nodes: [sdpa_backward]")  # the one above
    assert lines[6].split() == ["2.0", "MiB", "repo/gone.py:4", "forward"] and len(lines) == 7
