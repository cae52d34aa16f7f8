"""moe_fuse.debug's folder: a folder that cannot take the dumps never fails a compile, and only what moe_fuse
marked as its own is ever removed or overwritten."""

import json
import warnings

import pytest
import torch

from moe_fuse import debug
from support.models import qwen3_moe, token_batch


def dump(folder, graph="graph_000"):
    """One graph's dumps into ``folder`` as the backend writes them; the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        debug.emit(debug.GraphReport(graph=graph), "before", "after", str(folder))
    return [str(w.message) for w in caught]


@pytest.fixture(autouse=True)
def fresh_debug_state(monkeypatch):
    """Every test a new process as far as the debug folder goes: no folder started, no warning given yet."""
    monkeypatch.setattr(debug, "_started_dirs", set())
    monkeypatch.setattr(debug, "_warned", set())


@pytest.mark.parametrize("where", ["option", "environment"])
def test_a_debug_folder_that_cannot_be_written_warns_and_the_compile_goes_on(where, tmp_path, monkeypatch):
    """A debug_dir that is a file (or, from a stale $MOE_FUSE_DEBUG_DIR, a folder under one): a warning naming the
    folder and the error, the block still fused, the step still run."""
    (tmp_path / "afile").write_text("not a folder")
    options = {"moe_fuse.inner": "eager"}
    if where == "option":
        folder = str(tmp_path / "afile")
        options["moe_fuse.debug_dir"] = folder
        error = f"NotADirectoryError: [Errno 20] Not a directory: '{folder}/graph_"
    else:
        folder = str(tmp_path / "afile" / "dumps")
        monkeypatch.setenv("MOE_FUSE_DEBUG_DIR", folder)
        error = f"NotADirectoryError: [Errno 20] Not a directory: '{folder}'"
    model = qwen3_moe(torch.float32, num_hidden_layers=1)
    want = model(input_ids=token_batch()).logits
    torch._dynamo.reset()
    with debug.collect_reports() as reports, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(model, backend="moe_fuse", options=options)(input_ids=token_batch()).logits
    torch._dynamo.reset()
    torch.testing.assert_close(got, want)
    assert sorted(m["pattern"] for r in reports for m in r.matches) == ["grouped_mm_experts", "softmax_topk_router"]
    messages = [str(w.message) for w in caught if "debug folder" in str(w.message)]
    assert len(messages) == 1, messages  # once per folder, not once per graph
    assert messages[0].startswith(f"moe_fuse: no debug dumps in the debug folder {folder!r} ({error}")
    assert messages[0].endswith("compiling without them (moe_fuse.debug_dir / $MOE_FUSE_DEBUG_DIR)")
    assert (tmp_path / "afile").read_text() == "not a folder"


def test_files_moe_fuse_did_not_write_are_never_removed(tmp_path):
    """A user's summary.txt, a graph_007/report.json and an empty graph_123/ look like dumps but carry no mark:
    the first dump of a run leaves them as they are, and does not append to the user's summary.txt."""
    (tmp_path / "summary.txt").write_text("my summary")
    (tmp_path / "graph_007").mkdir()
    (tmp_path / "graph_007" / "report.json").write_text("my report")
    (tmp_path / "graph_123").mkdir()
    messages = dump(tmp_path)
    assert (tmp_path / "summary.txt").read_text() == "my summary"
    assert (tmp_path / "graph_007" / "report.json").read_text() == "my report"
    assert list((tmp_path / "graph_007").iterdir()) == [tmp_path / "graph_007" / "report.json"]
    assert list((tmp_path / "graph_123").iterdir()) == []
    assert sorted(p.name for p in (tmp_path / "graph_000").iterdir()) == [
        ".moe_fuse", "after.py", "before.py", "report.json", "summary.txt"]
    assert messages == [f"moe_fuse: {tmp_path}/summary.txt was not written by moe_fuse (no .moe_fuse beside it): "
                        f"the graphs' summaries are not appended to it"]


def test_a_graph_folder_moe_fuse_did_not_make_is_not_written_into(tmp_path):
    (tmp_path / "graph_007").mkdir()
    (tmp_path / "graph_007" / "report.json").write_text("my report")
    messages = dump(tmp_path, "graph_007")
    assert list((tmp_path / "graph_007").iterdir()) == [tmp_path / "graph_007" / "report.json"]
    assert (tmp_path / "graph_007" / "report.json").read_text() == "my report"
    assert messages == [f"moe_fuse: {tmp_path}/graph_007 was not made by moe_fuse (it holds no .moe_fuse): this "
                        f"graph's dumps are not written into it"]
    assert "moe_fuse graph_007" in (tmp_path / "summary.txt").read_text()  # the summary still lists it


def test_a_new_run_removes_only_the_earlier_runs_marked_dumps(tmp_path, monkeypatch):
    for graph in ("graph_000", "graph_001"):  # an earlier, longer run
        assert dump(tmp_path, graph) == []
    (tmp_path / "graph_001" / "mine.txt").write_text("a user's file in a dump folder")
    (tmp_path / "notes.txt").write_text("a user's file")
    monkeypatch.setattr(debug, "_started_dirs", set())  # a new process
    debug.emit(debug.GraphReport(graph="graph_000", compile_id="this run"), "new before", "new after", str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".moe_fuse", "graph_000", "graph_001", "notes.txt",
                                                         "summary.txt"]
    assert (tmp_path / "graph_000" / "before.py").read_text() == "new before"
    assert json.loads((tmp_path / "graph_000" / "report.json").read_text())["compile_id"] == "this run"
    assert sorted(p.name for p in (tmp_path / "graph_001").iterdir()) == [".moe_fuse", "mine.txt"]
    assert [line for line in (tmp_path / "summary.txt").read_text().splitlines() if line.startswith("moe_fuse ")] == [
        "moe_fuse graph_000 (compile this run): 0 rewrite(s), 0 left alone"]
    assert (tmp_path / "notes.txt").read_text() == "a user's file"
