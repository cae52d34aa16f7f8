"""What the backend did, shown three ways: a debug folder, logging, tlparse.

Per compiled graph the debug folder gets ``before.py`` and ``after.py``
(readable graph code), ``report.json`` and ``summary.txt``, marked as moe_fuse's by a ``.moe_fuse`` file
beside them. A folder that cannot take the dumps is warned about; the compile goes on without them.
``TORCH_LOGS="+moe_fuse"`` logs the summary (INFO) and the graphs (DEBUG);
``trace_structured`` artifacts put the same into tlparse.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import warnings
from dataclasses import dataclass, field

import torch

from . import config
from .pipeline.graph import describe_node

log = logging.getLogger("moe_fuse")

_graph_ids = itertools.count()
_sinks: list[list] = []  # explain() collects reports here
_warned: set[str] = set()
_started_dirs: set[str] = set()  # debug folders this process has written to
_DUMP_FILES = ("before.py", "after.py", "report.json", "summary.txt")
_ADVICE = ("eager_experts_loop", "eager_checkpoint")  # rejections also warned about, once per reason
_MARK = ".moe_fuse"  # in every folder moe_fuse dumps into; only the dump files of a marked folder are removed


@dataclass
class GraphReport:
    graph: str
    compile_id: str = ""
    matches: list[dict] = field(default_factory=list)
    rejected: list[dict] = field(default_factory=list)
    settings: dict = field(default_factory=dict)  # every config value this graph was compiled with

    def match(self, cand, where: str, nodes_replaced: int, verified: bool):
        self.matches.append(
            {
                "pattern": cand.pattern,
                **cand.spec.to_json(),
                "verified": verified,
                "nodes_replaced": nodes_replaced,
                "where": _where(where, cand.anchor),
                "notes": list(cand.notes),
            }
        )

    def rewrite(self, pattern: str, where: str, node, detail: dict):
        """A rewrite proved exactly rather than by probes (e.g. a constant causal mask), with what it found."""
        self.matches.append(
            {"pattern": pattern, **detail, "verified": "proved", "nodes_replaced": 0, "where": _where(where, node),
             "notes": []}
        )

    def reject(self, pattern: str, reason: str, where: str, node=None, notes=()):
        """``notes``: what the pattern noted about a candidate that verification then turned down."""
        self.rejected.append({"pattern": pattern, "reason": reason, "where": _where(where, node), "notes": list(notes)})
        if pattern in _ADVICE and reason not in _warned:  # once per advice, not per graph
            _warned.add(reason)
            warnings.warn(f"moe_fuse: {reason}", stacklevel=2)

    def to_json(self) -> dict:
        return {"graph": self.graph, "compile_id": self.compile_id, "matches": self.matches, "rejected": self.rejected,
                "settings": {k: v if v is None or isinstance(v, (bool, int, float, str)) else str(v)
                             for k, v in self.settings.items()}}

    def summary(self) -> str:
        lines = [f"moe_fuse {self.graph} (compile {self.compile_id}): "
                 f"{len(self.matches)} rewrite(s), {len(self.rejected)} left alone"]
        changed = {k: v for k, v in self.settings.items() if v != config.SETTINGS[k].default}
        lines.append("  settings: " + (", ".join(f"{k}={v!r}" for k, v in changed.items()) or "defaults")
                     + " (config)")
        for m in self.matches:
            if "num_experts" not in m:  # not an MoE block (see GraphReport.rewrite)
                detail = " ".join(f"{k}={v}" for k, v in m.items() if k not in ("pattern", "verified", "nodes_replaced",
                                                                               "where", "notes"))
                lines.append(f"  rewrote  {m['pattern']:<22} {detail} verified={m['verified']} at {m['where']}")
                continue
            shape = f"E={m['num_experts']} k={m['top_k']} H={m['hidden']}"
            if "intermediate" in m:
                shape += f" I={m['intermediate']}"
            if m.get("epilogue", "silu") != "silu":  # the activation and its constants (spec.Epilogue)
                shape += f" epilogue={m['epilogue']}"
            lines.append(f"  fused    {m['pattern']:<22} {shape} {m['dtype']:<8} "
                         f"verified={m['verified']} nodes={m['nodes_replaced']} at {m['where']}")
            lines.extend(f"           note: {note}" for note in m.get("notes", ()))
        for r in self.rejected:
            lines.append(f"  unfused  {r['pattern']:<22} at {r['where']}: {r['reason']}")
            lines.extend(f"           note: {note}" for note in r.get("notes", ()))
        return "\n".join(lines)


def _where(subgraph: str, node) -> str:
    return ":".join(part for part in (subgraph, describe_node(node)) if part)


def new_report() -> GraphReport:
    compile_id = torch._guards.CompileContext.current_compile_id()
    return GraphReport(graph=f"graph_{next(_graph_ids):03d}", compile_id=str(compile_id or ""),
                       settings=config.values())


EAGER_CHECKPOINT_REASON = (
    "Dynamo ran a region eagerly, without a graph, because it mutates state from outside a higher-order op's body "
    "(graph break 'HOP: Unsafe side effect', e.g. in a layer under activation checkpointing): moe_fuse never saw "
    "that code, so nothing in it is fused (results are unchanged). transformers' output_router_logits=True does this "
    "under gradient checkpointing: its hook appends each layer's router logits to a list outside the checkpoint. "
    "Set torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True before the first call: Dynamo "
    "then traces the checkpointed layers, their side effects running in the forward and not again in the "
    "backward's recomputation (where transformers' hook records nothing in eager either); or pass "
    "output_router_logits=False."
)
_eager_checkpoints_seen = 0


def note_eager_checkpoints(report: GraphReport):
    """Dynamo gives up on a checkpointed region whose body mutates outer state (transformers' router-logits hook)
    and runs it eagerly: it never reaches the backend. Counted by Dynamo's graph-break counters; each new one since
    the backend's previous graph goes into this graph's report."""
    global _eager_checkpoints_seen
    from torch._dynamo.utils import counters

    seen = sum(n for kind in ("unimplemented", "graph_break") for reason, n in counters[kind].items()
               if str(reason).startswith("HOP: Unsafe side effect"))
    if seen > _eager_checkpoints_seen:
        report.reject("eager_checkpoint", EAGER_CHECKPOINT_REASON, "(no graph)")
    _eager_checkpoints_seen = seen


def graph_code(gm: torch.fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


def emit(report: GraphReport, before: str, after: str, debug_dir: str | None):
    summary = report.summary()
    log.info("%s", summary)
    log.debug("moe_fuse %s before:\n%s", report.graph, before)
    log.debug("moe_fuse %s after:\n%s", report.graph, after)
    payload = json.dumps(report.to_json(), indent=2)
    torch._logging.trace_structured(
        "artifact", metadata_fn=lambda: {"name": "moe_fuse_report", "encoding": "json"}, payload_fn=lambda: payload
    )
    for name, code in (("moe_fuse_graph_before", before), ("moe_fuse_graph_after", after)):
        torch._logging.trace_structured(
            "artifact", metadata_fn=lambda name=name: {"name": name, "encoding": "string"}, payload_fn=lambda c=code: c
        )
    if debug_dir:
        files = {"before.py": before, "after.py": after, "report.json": payload, "summary.txt": summary + "\n"}
        try:
            _start_afresh(debug_dir)
            _write_graph(os.path.join(debug_dir, report.graph), files)
            _append_summary(debug_dir, summary + "\n")
        except OSError as e:  # dumps are for debugging: they never fail a compile
            _warn_once(f"moe_fuse: no debug dumps in the debug folder {debug_dir!r} ({type(e).__name__}: {e}); "
                       f"compiling without them (moe_fuse.debug_dir / $MOE_FUSE_DEBUG_DIR)", key=f"dumps {debug_dir}")
    for sink in _sinks:
        sink.append(report)


def _warn_once(message: str, key: str | None = None):
    """``message`` as a warning, once per ``key`` (default: the message)."""
    key = key or message
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def _ours(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, _MARK))


def _mark(folder: str, names) -> None:
    path = os.path.join(folder, _MARK)
    if not os.path.isfile(path):
        with open(path, "w") as f:
            f.write(f"moe_fuse wrote {', '.join(names)} in this folder; the first dump of its next run here removes "
                    f"them and nothing else\n")


def _write_graph(folder: str, files: dict):
    """One graph's dumps into ``folder``: made and marked, or one moe_fuse marked before (an earlier graph of this
    process, or, in a distributed job, another rank's); a folder of that name moe_fuse did not make is left alone."""
    try:
        os.makedirs(folder)
    except FileExistsError:
        if not _ours(folder):
            _warn_once(f"moe_fuse: {folder} was not made by moe_fuse (it holds no {_MARK}): "
                       f"this graph's dumps are not written into it")
            return
    _mark(folder, _DUMP_FILES)
    for name, text in files.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)


def _append_summary(debug_dir: str, text: str):
    path = os.path.join(debug_dir, "summary.txt")
    if os.path.exists(path) and not _ours(debug_dir):
        _warn_once(f"moe_fuse: {path} was not written by moe_fuse (no {_MARK} beside it): the graphs' summaries "
                   f"are not appended to it")
        return
    _mark(debug_dir, ("summary.txt",))
    with open(path, "a") as f:
        f.write(text)


def _start_afresh(debug_dir: str):
    """This process's first dump into ``debug_dir`` removes the dumps an earlier run left there.

    Graph numbers restart at graph_000 in every process, so an earlier run's folders would be overwritten
    or, past this run's last number, mixed in with it, and ``summary.txt`` would list both runs. Only what
    moe_fuse marked as its own goes: the dump files of a ``graph_NNN`` folder holding a ``.moe_fuse`` mark
    (the folder too, when nothing else is left in it) and ``summary.txt`` beside a mark; anything else stays,
    also in those folders. In a distributed job nothing goes, since the other ranks may be writing to the
    same folder."""
    key = os.path.realpath(debug_dir)
    if key in _started_dirs:
        return
    _started_dirs.add(key)
    dist = torch.distributed
    if not os.path.isdir(debug_dir) or (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    removed = 0
    for name in sorted(os.listdir(debug_dir)):
        path = os.path.join(debug_dir, name)
        if re.fullmatch(r"graph_\d{3,}", name) and os.path.isdir(path) and _ours(path):
            _remove_files(path, _DUMP_FILES)
            if os.listdir(path) == [_MARK]:
                os.remove(os.path.join(path, _MARK))
                os.rmdir(path)
            removed += 1
    if _ours(debug_dir):
        _remove_files(debug_dir, ("summary.txt",))
    if removed:
        log.info("moe_fuse: removed the dumps of %d graph(s) of an earlier run from %s", removed, debug_dir)


def _remove_files(folder: str, names):
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)


# --------------------------------------------------------------------------- explain


@dataclass
class Explanation:
    """Reports of every graph moe_fuse compiled while explaining; printable."""

    graphs: list[GraphReport]

    @property
    def matches(self) -> list[dict]:
        return [m for g in self.graphs for m in g.matches]

    @property
    def rejected(self) -> list[dict]:
        return [r for g in self.graphs for r in g.rejected]

    def to_json(self) -> dict:
        return {"graphs": [g.to_json() for g in self.graphs]}

    def __str__(self) -> str:
        head = (f"moe_fuse explain: {len(self.graphs)} graph(s), {len(self.matches)} rewrite(s), "
                f"{len(self.rejected)} region(s) left alone")
        return "\n".join([head] + [g.summary() for g in self.graphs] + ["moe_fuse settings:", config.describe()])


@contextlib.contextmanager
def collect_reports():
    sink: list[GraphReport] = []
    _sinks.append(sink)
    try:
        yield sink
    finally:
        _sinks.remove(sink)
