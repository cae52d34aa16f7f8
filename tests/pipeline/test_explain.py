"""moe_fuse.explain, logging (TORCH_LOGS=+moe_fuse) and tlparse artifacts."""

import json
import os
import subprocess
import sys
import textwrap

import torch

import moe_fuse
from support.models import qwen3_moe, token_batch


def test_explain_reports_every_block():
    model = qwen3_moe(torch.float32)
    explanation = moe_fuse.explain(model, input_ids=token_batch())
    patterns = sorted(m["pattern"] for m in explanation.matches)
    assert patterns == ["grouped_mm_experts"] * 2 + ["softmax_topk_router"] * 2
    text = str(explanation)
    assert text.startswith("moe_fuse explain:") and "4 rewrite(s)" in text
    assert "fused    grouped_mm_experts" in text and "layers.1.mlp.experts" in text
    json.dumps(explanation.to_json())


SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from support.models import qwen3_moe, token_batch
    model = qwen3_moe(torch.float32, num_hidden_layers=1)
    torch.compile(model, backend="moe_fuse", options={{"moe_fuse.inner": "eager"}})(input_ids=token_batch())
    """
)


def run_script(env_extra, tmp_path):
    env = {**os.environ, **env_extra}
    script = SCRIPT.format(tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)


def test_torch_logs_shows_the_rewrite(tmp_path):
    result = run_script({"TORCH_LOGS": "+moe_fuse"}, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "moe_fuse graph_000" in result.stderr and "fused    grouped_mm_experts" in result.stderr
    assert "torch.ops.moe_fuse.experts.default" in result.stderr  # the after-graph, at DEBUG


def test_trace_structured_artifacts(tmp_path):
    result = run_script({"TORCH_TRACE": str(tmp_path)}, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    trace = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    for name in ("moe_fuse_report", "moe_fuse_graph_before", "moe_fuse_graph_after"):
        assert f'"name": "{name}"' in trace


DEBUG_DIR_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from support.models import qwen3_moe, token_batch
    options = {{"moe_fuse.inner": "eager", "moe_fuse.debug_dir": {debug_dir!r}}}
    for layers in (1, 2):  # two compiles in one process: both graphs stay
        torch.compile(qwen3_moe(torch.float32, num_hidden_layers=layers), backend="moe_fuse", options=options)(
            input_ids=token_batch())
    """
)


def test_debug_dir_holds_this_run_only(tmp_path):
    """A second run into the same folder replaces the first run's dumps (graph numbers restart in every
    process) and leaves everything else there alone."""
    stale = {"graph_000": ["before.py", "summary.txt"], "graph_001": ["before.py"], "graph_007": ["report.json"]}
    for name, files in stale.items():  # an earlier, longer run, its folders marked as moe_fuse's
        (tmp_path / name).mkdir()
        for f in [*files, ".moe_fuse"]:
            (tmp_path / name / f).write_text("stale")
    (tmp_path / "summary.txt").write_text("moe_fuse graph_007 stale\n")
    (tmp_path / ".moe_fuse").write_text("stale")
    (tmp_path / "graph_001" / "mine.txt").write_text("a user's file")  # not ours, in a folder of ours: kept
    (tmp_path / "notes.txt").write_text("a user's file")

    script = DEBUG_DIR_SCRIPT.format(tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), debug_dir=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]

    summary = (tmp_path / "summary.txt").read_text()
    assert "stale" not in summary
    graphs = [line.split()[1] for line in summary.splitlines() if line.startswith("moe_fuse graph_")]
    assert graphs == [f"graph_{i:03d}" for i in range(len(graphs))] and 2 <= len(graphs) < 7, summary
    assert "layers.1.mlp.experts" in summary  # the second compile's graph is there too
    assert sorted(p.name for p in tmp_path.iterdir()) == [".moe_fuse", *graphs, "notes.txt", "summary.txt"]  # 007 gone
    for g in graphs:
        assert "stale" not in (tmp_path / g / "before.py").read_text()
        assert (tmp_path / g / "report.json").exists()
    assert (tmp_path / "graph_001" / "mine.txt").read_text() == "a user's file"
    assert (tmp_path / "notes.txt").read_text() == "a user's file"


def test_debug_dir_left_alone_in_a_distributed_job(tmp_path, monkeypatch):
    """Ranks may share the folder: none of them removes what is there."""
    from moe_fuse import debug

    (tmp_path / "graph_000").mkdir()
    (tmp_path / "graph_000" / "report.json").write_text("another rank's")
    (tmp_path / "summary.txt").write_text("another rank's")
    for folder in (tmp_path, tmp_path / "graph_000"):
        (folder / ".moe_fuse").write_text("moe_fuse's")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(debug, "_started_dirs", set())
    debug._start_afresh(str(tmp_path))
    assert (tmp_path / "graph_000" / "report.json").read_text() == "another rank's"
    assert (tmp_path / "summary.txt").read_text() == "another rank's"
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)  # one rank: its own folder
    monkeypatch.setattr(debug, "_started_dirs", set())
    debug._start_afresh(str(tmp_path))
    assert list(tmp_path.iterdir()) == [tmp_path / ".moe_fuse"]
