"""bench/common.py in process: GPU kind names, variant parsing, timing in turn, the memory-at-peak replay, the
result files."""

import json
import time

import pytest
import torch

import common


@pytest.mark.parametrize("name, kind", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                        ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "rtx4090")])
def test_gpu_kind(monkeypatch, name, kind):
    monkeypatch.setattr(common, "device_name", lambda dev: name)
    assert common.gpu_kind(torch.device("cuda")) == kind
    assert common.gpu_kind(torch.device("cpu")) == "cpu"


def test_parse_variants():
    v = common.parse_variants("eager, moe_fuse ,moe_fuse:grouped_mm=False:ragged_min_rows=0,moe_fuse:inner=eager",
                              ["eager", "moe_fuse"])
    assert [x.name for x in v] == ["eager", "moe_fuse", "moe_fuse:grouped_mm=False:ragged_min_rows=0",
                                   "moe_fuse:inner=eager"]
    assert v[2].base == "moe_fuse" and v[2].settings == {"grouped_mm": False, "ragged_min_rows": 0}
    assert v[3].settings == {"inner": "eager"}  # a bare word is a string
    with pytest.raises(ValueError, match="unknown moe_fuse setting"):
        common.parse_variants("moe_fuse:GROUPED_MM=False", ["moe_fuse"])
    with pytest.raises(ValueError, match="expected True or False"):
        common.parse_variants("moe_fuse:grouped_mm=0", ["moe_fuse"])


def test_time_ms_resets_gradients_and_calls_before():
    leaf = torch.zeros(1, requires_grad=True)
    seen, befores = [], []

    def step():
        seen.append(leaf.grad)
        leaf.grad = torch.ones(1)
        time.sleep(0.002)

    t = common.time_ms(step, torch.device("cpu"), reps=4, warmup=1, grad_to_none=[leaf], before=lambda: befores.append(1))
    assert t["n"] == 4 and len(befores) == 4 and seen == [None] * 5
    assert 2.0 <= t["p20"] <= t["ms"] <= t["p80"] < 50.0


def test_in_turn_rotates_the_start():
    order = []
    readings = common.in_turn({n: (lambda n=n: order.append(n) or len(order)) for n in "abc"}, rounds=3)
    assert order == list("abcbcacab")
    assert readings == {"a": [1, 6, 8], "b": [2, 4, 9], "c": [3, 5, 7]}


def test_back_to_back():
    leaf = torch.zeros(1, requires_grad=True)
    leaf.grad = torch.ones(1)
    got = common.back_to_back(lambda: time.sleep(0.003), torch.device("cpu"), [leaf], n=4)
    assert 3.0 <= got["host_ms"] <= got["ms"] < 40.0 and leaf.grad is None


MiB = 2**20


def ev(action, addr, size, fn="model.py", line=1):
    frames = [{"filename": "/x/site-packages/torch/cuda/alloc.py", "line": 9, "name": "empty"},
              {"filename": f"/repo/{fn}", "line": line, "name": "forward"}]
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def test_memory_at_the_peak():
    """The highest live set, not the last one; blocks from before the trace do not count; grouped by the first frame
    outside torch, largest first."""
    events = [ev("alloc", 1, 4 * MiB, "a.py", 10), ev("alloc", 2, 4 * MiB, "a.py", 10), ev("alloc", 3, 2 * MiB, "b.py", 7),
              ev("free_requested", 1, 4 * MiB), ev("free_completed", 1, 4 * MiB),
              ev("free_requested", 99, 64 * MiB),  # allocated before the trace
              ev("alloc", 4, 1 * MiB, "c.py", 3)]  # 7 MiB live now, below the 10 MiB peak
    peak, held = common.live_at_peak(events)
    assert peak == 10 * MiB and sorted(e["addr"] for e in held) == [1, 2, 3]
    lines = common.peak_sites(events)
    assert lines[0] == "peak 10 MiB over the start, 3 blocks live"
    assert lines[1].split() == ["8.0", "MiB", "x2", "repo/a.py:10", "forward"]
    assert lines[2].split() == ["2.0", "MiB", "x1", "repo/b.py:7", "forward"] and len(lines) == 3


def test_write_results(tmp_path, capsys):
    drawn = []
    stem = common.write_results("demo", torch.device("cpu"), tmp_path / "r", {"rows": [1]}, "# demo\n\n| a |",
                                plot=lambda plt: drawn.append(plt) or plt.plot([1, 2]))
    assert stem == tmp_path / "r" / "demo_cpu"
    assert json.loads((tmp_path / "r" / "demo_cpu.json").read_text()) == {"rows": [1]}
    assert (tmp_path / "r" / "demo_cpu.md").read_text() == "# demo\n\n| a |\n"
    png = (tmp_path / "r" / "demo_cpu.png").exists()
    assert png == bool(drawn) and (png or "(no PNG: matplotlib not importable" in capsys.readouterr().out)
