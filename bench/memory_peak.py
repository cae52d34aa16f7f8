#!/usr/bin/env python3
"""What is allocated at a step's memory peak: record a CUDA allocator trace around one call, then replay it.

    from memory_peak import record          # in a bench script, on the GPU
    record(run, "bench_out/snap_glm4_moe_moe_fuse.pickle")
    python3 bench/memory_peak.py bench_out/snap_*.pickle [--top 25]      # anywhere (no GPU needed)

torch.cuda.max_memory_allocated says how high a step goes, not what holds the memory there. The allocator's
trace (torch.cuda.memory._record_memory_history) lists every allocation and free with the Python stack that
made it; replaying it to the highest point gives the live blocks, which this groups by the first stack frame
outside torch (a model line, an Inductor-generated kernel call, a moe_fuse kernel wrapper). Only blocks
allocated while recording count: the parameters and whatever lived before the call are the base, as in
layer_bench.peak_mem_mb.
"""

import argparse
import pickle
import sys
from collections import defaultdict
from pathlib import Path

FREES = ("free_requested", "free")


def record(fn, path, max_entries=1_000_000):
    """Run fn() once with the allocator's trace on and write the snapshot to path (a pickle)."""
    import torch

    import inspect

    torch.cuda.synchronize()
    start = torch.cuda.memory._record_memory_history
    # clear_history: an earlier call's events would count as this one's
    fresh = {"clear_history": True} if "clear_history" in inspect.signature(start).parameters else {}
    start(max_entries=max_entries, stacks="python", **fresh)
    try:
        fn()
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def live_at_peak(events):
    """(peak bytes over the start, the alloc events live at that point) from one device's trace events."""
    live, cur, peak, peak_at = {}, 0, 0, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            cur += e["size"]
            if cur > peak:
                peak, peak_at = cur, i
        elif e["action"] in FREES and e["addr"] in live:  # a block allocated before the trace started: not ours
            cur -= live.pop(e["addr"])
    held = {}
    for e in events[:peak_at + 1]:
        if e["action"] == "alloc":
            held[e["addr"]] = e
        elif e["action"] in FREES:
            held.pop(e["addr"], None)
    return peak, list(held.values())


def where(event):
    """The first frame outside torch and this file: who asked for the block."""
    for f in event.get("frames", []):
        name = f.get("filename", "")
        if "/torch/" in name or name.endswith("memory_peak.py"):  # Inductor's generated code is not under torch/
            continue
        return f"{'/'.join(name.split('/')[-2:])}:{f.get('line')} {f.get('name')}"
    return "?"


def summary(events, top=25):
    """Lines: the peak, then the live blocks grouped by where they were allocated, largest first."""
    peak, held = live_at_peak(events)
    groups = defaultdict(lambda: [0, 0])
    for e in held:
        g = groups[where(e)]
        g[0] += e["size"]
        g[1] += 1
    lines = [f"peak {peak / 2**20:.0f} MiB over the start, {len(held)} blocks live"]
    for site, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {size / 2**20:9.1f} MiB  x{n:<4d} {site}")
    return lines


def _frame(event):
    for f in event.get("frames", []):
        name = f.get("filename", "")
        if "/torch/" not in name and not name.endswith("memory_peak.py"):
            return f
    return None


def _source(path, line):
    """(the line, the graph nodes Inductor names above it) of a generated file, where it is still on disk."""
    try:
        text = Path(path).read_text().splitlines()
    except OSError:
        return None, None
    if not 0 < line <= len(text):
        return None, None
    # Inductor writes a buffer's allocation first, then the comment naming the nodes of the kernel that fills it;
    # a call that allocates its own outputs (an extern op) comes after its comment
    after = text[line:line + 3] if "empty_strided" in text[line - 1] else []
    nodes = next((t.strip() for t in after if "Source Nodes" in t), None) or next(
        (t.strip() for t in reversed(text[max(0, line - 40):line]) if "Source Nodes" in t), None)
    return text[line - 1].strip(), nodes


def detail(events, top=12):
    """Lines: the largest blocks live at the peak one by one, with the line that allocated each and, for Inductor's
    generated code (read from disk: run this where the graphs were compiled), the graph nodes it names there."""
    _, held = live_at_peak(events)
    lines = []
    for e in sorted(held, key=lambda e: -e["size"])[:top]:
        lines.append(f"  {e['size'] / 2**20:9.1f} MiB  {where(e)}")
        f = _frame(e)
        if f is not None:
            code, nodes = _source(f.get("filename", ""), f.get("line", 0))
            if code:
                lines.append(f"      {code[:200]}")
            if nodes:
                lines.append(f"      {nodes[:400]}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshots", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--blocks", type=int, default=0, help="also list this many of the largest live blocks one by one")
    args = ap.parse_args()
    for path in args.snapshots:
        with open(path, "rb") as f:
            snap = pickle.load(f)
        traces = [t for t in snap.get("device_traces", []) if t]
        if not traces:
            sys.exit(f"{path}: no allocator trace in this snapshot")
        print(f"== {path}")
        print("\n".join(summary(traces[0], args.top)))
        if args.blocks:
            print("\n".join(detail(traces[0], args.blocks)))


if __name__ == "__main__":
    main()
