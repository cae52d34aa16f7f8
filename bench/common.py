"""What every benchmark of bench/ shares: timing, provenance, power and energy, the matmul peak, variants and the
result files.

    python bench/common.py      # prints this checkout's provenance (commit, sources hash, versions)

Timing: CUDA events around each call, L2 flushed before it, the median (p20 / p80 beside); on the CPU
perf_counter. ``in_turn`` times several steps round after round, each round starting one step later.
Provenance: the commit (``git describe``), a hash of the package's and bench/'s sources (a copy of the tree may
carry stale git metadata: the hash still names the code), GPU, versions, the command line.
Results: ``<bench>_<gpu kind>.{md,json,png}`` (``layer_h100.json``), one current file per GPU kind and benchmark,
overwritten by the next run; the PNG only where matplotlib imports.
"""
from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the checkout's moe_fuse wins over an installed one

import torch  # noqa: E402

RESULTS = ROOT / "bench" / "results"


# ---------------------------------------------------------------- provenance
def source_sha(root: Path = ROOT) -> str:
    """sha256 (12 hex digits) over the paths and bytes of moe_fuse/**/*.py and bench/*.py."""
    h = hashlib.sha256()
    for path in sorted([*root.glob("moe_fuse/**/*.py"), *root.glob("bench/*.py")]):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def git_commit(root: Path = ROOT) -> str:
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "unknown"


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or "cpu")


def gpu_kind(dev: torch.device) -> str:
    """A short name for result files: "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA GeForce RTX 4090" -> "rtx4090"."""
    if dev.type != "cuda":
        return "cpu"
    words = [w for w in re.split(r"[\s_-]+", device_name(dev).lower())
             if w and w not in ("nvidia", "geforce", "tesla")]
    for i, w in enumerate(words):
        if any(c.isdigit() for c in w):
            words = words[:i + 1]
            break
    return re.sub(r"[^a-z0-9]", "", "".join(words)) or "gpu"


def provenance(dev: torch.device) -> dict:
    """Where a figure comes from: commit, sources, GPU, versions, command line, moe_fuse settings."""
    meta = dict(commit=git_commit(), source_sha=source_sha(), gpu=device_name(dev), torch=torch.__version__,
                cuda=torch.version.cuda, python=platform.python_version(),
                command="python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]))
    for name in ("triton", "transformers"):
        try:
            meta[name] = __import__(name).__version__
        except ImportError:
            meta[name] = None
    from moe_fuse import config

    meta["moe_fuse_config"] = {k: v if v is None or isinstance(v, (bool, int, float, str)) else str(v)
                               for k, v in config.values().items()}
    return meta


def header(meta: dict) -> str:
    """The provenance as one markdown line, for the head of a result table."""
    return (f"{meta['gpu']}; commit {meta['commit']} (sources {meta['source_sha']}); torch {meta['torch']}, triton "
            f"{meta.get('triton')}, transformers {meta.get('transformers')}; `{meta['command']}`")


# ---------------------------------------------------------------- timing
def sync(dev: torch.device):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


_FLUSH: dict = {}


def _flush_l2(dev: torch.device):
    """Overwrite 256 MB so that a timed call does not start with its inputs in L2."""
    if dev not in _FLUSH:
        _FLUSH[dev] = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    _FLUSH[dev].zero_()


def time_ms(fn: Callable, dev: torch.device, *, rep_ms: float = 300.0, warmup: int = 3, grad_to_none=(),
            power: bool = False, reps: int | None = None, before: Callable | None = None) -> dict:
    """{"ms": median, "p20", "p80", "n"} of ``fn()`` over about rep_ms of calls (5 to 1000 of them; ``reps`` fixes
    the count); the gradients of ``grad_to_none`` reset before every call, ``before()`` called before each (outside
    the timing: a barrier of the ranks). CUDA: events around each call, L2 flushed before it; with ``power`` also
    "power" (``PowerMeter.stats``)."""
    def call():
        for t in grad_to_none:
            t.grad = None
        fn()

    for _ in range(warmup):
        call()
    sync(dev)
    n = reps
    if n is None:
        t0 = time.perf_counter()
        call()
        sync(dev)
        n = int(min(1000, max(5, rep_ms / max((time.perf_counter() - t0) * 1e3, 1e-3))))
    cuda = dev.type == "cuda"
    marks = []
    with PowerMeter() if power and cuda else contextlib.nullcontext() as meter:
        for _ in range(n):
            if cuda:
                _flush_l2(dev)
            for t in grad_to_none:
                t.grad = None
            if before is not None:
                before()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                marks.append((start, end))
            else:
                t0 = time.perf_counter()
                fn()
                marks.append((time.perf_counter() - t0) * 1e3)
        sync(dev)
    times = [start.elapsed_time(end) for start, end in marks] if cuda else marks
    q = statistics.quantiles(times, n=10) if len(times) > 1 else times * 9
    out = {"ms": statistics.median(times), "p20": q[1], "p80": q[7], "n": n}
    if meter is not None:
        out["power"] = meter.stats(out["ms"])
    return out


def timing(smoke: bool, rep_ms: float = 300.0) -> dict:
    """time_ms's arguments: about rep_ms of calls after 5 warm-up calls; a CPU smoke run (which checks the script,
    not the speed) two calls."""
    return {"reps": 2, "warmup": 0} if smoke else {"rep_ms": rep_ms, "warmup": 5}


def in_turn(timers: dict, rounds: int) -> dict:
    """Each timer (a call returning a reading) run ``rounds`` times, the timers in turn, each round starting one
    later: none is always timed right after the same one (at its power limit a card's clock follows what ran
    before). Returns each timer's readings in order."""
    names = list(timers)
    out = {name: [] for name in names}
    for r in range(rounds):
        s = r % len(names) if names else 0
        for name in names[s:] + names[:s]:
            out[name].append(timers[name]())
    return out


def back_to_back(fn: Callable, dev: torch.device, grad_to_none=(), n: int = 10) -> dict:
    """``n`` calls issued back to back, no flush or synchronize between them: {"host_ms": the host's time to issue
    one, timed before the final synchronize (about the step's ms: host-bound), "ms": one call's share of the wall
    time to the end (the steady rate of steps queued one after another, as a model's layers are)}."""
    for _ in range(3):
        fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        for t in grad_to_none:
            t.grad = None
        fn()
    host = (time.perf_counter() - t0) * 1e3 / n
    sync(dev)
    return {"host_ms": host, "ms": (time.perf_counter() - t0) * 1e3 / n}


def allocator_churn(fn: Callable, dev: torch.device, grad_to_none=(), n: int = 5) -> dict | None:
    """Per call of ``fn``, over ``n`` calls after warm ones: how often the caching allocator asked the driver for
    memory (``cudaMalloc``) and how often it freed its whole cache to retry a failed request (each retry
    synchronizes the device and frees and re-asks for blocks). Both are 0 in a steady step with room to spare;
    where they are not, the step waits on the allocator. CUDA only; None where this torch does not count them."""
    if dev.type != "cuda":
        return None
    for _ in range(2):
        for t in grad_to_none:
            t.grad = None
        fn()
    sync(dev)
    before = torch.cuda.memory_stats(dev)
    for _ in range(n):
        for t in grad_to_none:
            t.grad = None
        fn()
    sync(dev)
    after = torch.cuda.memory_stats(dev)
    keys = {"mallocs": "num_device_alloc", "retries": "num_alloc_retries"}
    if not all(key in after for key in keys.values()):
        return None
    return {name: (after[key] - before[key]) / n for name, key in keys.items()}


def available_bytes(dev: torch.device) -> int:
    """What a new tensor can still take: the driver's free memory and what the allocator holds unused."""
    return torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)


def fill_device(dev: torch.device, free_gib: float, chunk_gib: float = 1.0) -> list:
    """Tensors that leave about ``free_gib`` GiB of the device free (as a job's own weights and optimizer state
    would): what the driver has free plus what the allocator holds unused, taken in ``chunk_gib`` pieces until
    the rest is within 64 MiB of ``free_gib`` (asked again after each piece: memory freed meanwhile is taken too).
    Keep the list alive while measuring; drop it to give the memory back."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    fill = []
    while True:
        take = available_bytes(dev) - int(free_gib * 2**30)
        if take < 64 << 20:
            return fill
        fill.append(torch.empty(min(int(chunk_gib * 2**30), take), dtype=torch.uint8, device=dev))


def peak_mem_mb(fn: Callable, dev: torch.device, grad_to_none=()) -> float | None:
    """Device memory one call allocates at its peak over what was allocated before it (CUDA only)."""
    if dev.type != "cuda":
        return None
    for t in grad_to_none:
        t.grad = None
    sync(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    fn()
    sync(dev)
    return (torch.cuda.max_memory_allocated(dev) - base) / 2**20


def held_mb(fn: Callable, dev: torch.device) -> float | None:
    """Device memory that stays allocated while ``fn()``'s result is alive (a training forward: its output and what
    it saves for the backward), over what was allocated before (CUDA only)."""
    if dev.type != "cuda":
        return None
    sync(dev)
    base = torch.cuda.memory_allocated(dev)
    out = fn()
    sync(dev)
    held = torch.cuda.memory_allocated(dev) - base
    del out
    return held / 2**20


def matmul_peak(dev: torch.device, dtype: torch.dtype) -> dict:
    """The dense matmul rate measured here (8192^3 on a GPU, 512^3 on the CPU): the 100% of "% of peak"."""
    n = 8192 if dev.type == "cuda" else 512
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    ms = time_ms(lambda: a @ b, dev, rep_ms=500 if dev.type == "cuda" else 50)["ms"]
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "ms": ms, "tflops": 2 * n**3 / (ms * 1e-3) / 1e12}


def rel_err(out: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 26) -> float:
    """||out - ref|| / ||ref|| in float64, in chunks (expert weight gradients have ~1e9 elements). NaN stays NaN."""
    o, r = out.detach().reshape(-1), ref.detach().reshape(-1)
    num = den = 0.0
    for i in range(0, o.numel(), chunk):
        a, b = o[i:i + chunk].double(), r[i:i + chunk].double()
        num += (a - b).square().sum().item()
        den += b.square().sum().item()
    return (num ** 0.5) / max(den ** 0.5, 1e-30)


# ---------------------------------------------------------------- power and energy
_NVML: list = []


def energy_mj(index: int = 0) -> float | None:
    """The GPU's total-energy counter in mJ (NVML), or None without NVML."""
    import ctypes

    if not _NVML:
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            handle = ctypes.c_void_p()
            if lib.nvmlInit_v2() or lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)):
                raise OSError("NVML init failed")
            _NVML.append((lib, handle))
        except OSError:
            _NVML.append(None)
    if _NVML[0] is None:
        return None
    lib, handle = _NVML[0]
    value = ctypes.c_ulonglong()
    return None if lib.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(value)) else float(value.value)


class PowerMeter:
    """While it is entered: nvidia-smi's SM clock, power and power-cap flag every 100 ms, and the NVML energy
    counter's steps (read on a thread, never in the timed loop). ``stats(ms)``: {"sm_mhz", "watts", "limit_w",
    "capped" (share of samples at the software power cap), "mj_per_call" (mean power between the counter's first
    and last step x ms)}; empty without nvidia-smi / NVML."""

    QUERY = "clocks.sm,power.draw,enforced.power.limit,clocks_event_reasons.active"

    def __init__(self):
        self.samples, self.edges, self.proc = [], [], None
        self.stop = threading.Event()

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                                          "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            threading.Thread(target=lambda: self.samples.extend(iter(self.proc.stdout.readline, "")),
                             daemon=True).start()
        except OSError:
            self.proc = None
        self.poller = threading.Thread(target=self._poll, daemon=True)
        self.poller.start()
        return self

    def _poll(self):
        last = energy_mj()
        while last is not None and not self.stop.is_set():
            now = energy_mj()
            if now != last:
                self.edges.append((time.perf_counter(), now))
                last = now
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.stop.set()
        self.poller.join(timeout=5)
        if self.proc is not None:
            self.proc.terminate()

    def stats(self, ms: float | None = None) -> dict:
        vals = []
        for row in self.samples:
            try:
                mhz, watts, limit, reasons = (v.strip() for v in row.split(","))
                vals.append((float(mhz), float(watts), float(limit), int(reasons, 16)))
            except ValueError:
                continue
        out = {}
        if vals:
            med = lambda i: statistics.median(v[i] for v in vals)  # noqa: E731
            out.update(sm_mhz=med(0), watts=med(1), limit_w=med(2),
                       capped=sum(1 for v in vals if v[3] & 0x4) / len(vals))
        if ms is not None and len(self.edges) >= 2 and self.edges[-1][0] > self.edges[0][0]:
            (t0, e0), (t1, e1) = self.edges[0], self.edges[-1]
            out["mj_per_call"] = (e1 - e0) / (t1 - t0) / 1e3 * ms
        return out


# ---------------------------------------------------------------- variants
class Variant(NamedTuple):
    name: str       # as given: "moe_fuse:ragged_min_rows=0"
    base: str       # "moe_fuse"
    settings: dict  # {"ragged_min_rows": 0}: moe_fuse.config settings while it compiles and runs


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word: a string setting


def parse_variants(spec: str, bases) -> list[Variant]:
    """"inductor,moe_fuse,moe_fuse:grouped_mm=False:ragged_min_rows=0" -> Variants. A variant is a base name, then
    ``:name=value`` for each moe_fuse.config setting it changes (moe_fuse bases only). Raises ValueError on an
    unknown base or setting, or a value the setting does not take."""
    from moe_fuse import config

    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        base, *pairs = item.split(":")
        if base not in bases:
            raise ValueError(f"unknown variant {base!r}; known: {', '.join(bases)}")
        settings = {}
        for pair in pairs:
            name, eq, value = pair.partition("=")
            if not eq:
                raise ValueError(f"variant {item!r}: {pair!r} is not name=value")
            settings[name.strip()] = _value(value.strip())
        if settings and not base.startswith("moe_fuse"):
            raise ValueError(f"variant {item!r}: settings apply to the moe_fuse variants only")
        config.patch(settings)  # checks the names and values
        out.append(Variant(item, base, settings))
    return out


def compile_setup() -> None:
    """Make backend="moe_fuse" resolvable where the package is not installed (its entry point then missing), and let
    Dynamo keep a compiled graph per variant and grad mode of one module side by side."""
    import torch._dynamo as dynamo

    if "moe_fuse" not in dynamo.list_backends(exclude_tags=()):
        from moe_fuse.backend import moe_fuse_backend

        if "moe_fuse" not in dynamo.list_backends(exclude_tags=()):
            dynamo.register_backend(compiler_fn=moe_fuse_backend, name="moe_fuse")
    dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)


def moe_fuse_backend(settings: dict) -> Callable:
    """backend="moe_fuse" compiling under ``config.patch(settings)``, as a callable of its own: Dynamo keeps one
    compiled graph per backend callable, so two variants of one module never share a graph."""
    from moe_fuse import config
    from moe_fuse.backend import moe_fuse_backend as backend

    def moe_fuse_with_settings(gm, example_inputs, **kwargs):
        with config.patch(settings):
            return backend(gm, example_inputs, **kwargs)

    return moe_fuse_with_settings


def rewrites(reports) -> list[str]:
    """The patterns moe_fuse rewrote, from ``moe_fuse.debug.collect_reports()``'s list, sorted."""
    return sorted(m["pattern"] for g in reports for m in g.matches)


# ---------------------------------------------------------------- memory at the peak
def record_allocations(fn: Callable, dev: torch.device) -> list[dict]:
    """One call of fn with the CUDA allocator's trace on: its alloc / free events, with Python stacks."""
    sync(dev)
    record = torch.cuda.memory._record_memory_history
    try:
        record(max_entries=1_000_000, stacks="python", clear_history=True)  # no earlier call's events
    except TypeError:  # a torch without clear_history
        record(max_entries=1_000_000, stacks="python")
    try:
        fn()
        sync(dev)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return next((t for t in snap.get("device_traces", []) if t), [])


def live_at_peak(events: list[dict]) -> tuple[int, list[dict]]:
    """(peak bytes over the start, the alloc events live at that point). Blocks allocated before the trace do not
    count: their frees are ignored."""
    live, cur, peak, peak_at = {}, 0, 0, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            cur += e["size"]
            if cur > peak:
                peak, peak_at = cur, i
        elif e["action"] in ("free_requested", "free") and e["addr"] in live:
            cur -= live.pop(e["addr"])
    held = {}
    for e in events[:peak_at + 1]:
        if e["action"] == "alloc":
            held[e["addr"]] = e
        elif e["action"] in ("free_requested", "free"):
            held.pop(e["addr"], None)
    return peak, list(held.values())


def peak_sites(events: list[dict], top: int = 12) -> list[str]:
    """The peak, then what is live there grouped by the first stack frame outside torch (a model line, an
    Inductor-generated call, a moe_fuse kernel wrapper), largest first."""
    def site(e):
        for f in e.get("frames", []):
            name = f.get("filename", "")
            if "/torch/" not in name and not name.endswith("common.py"):
                return f"{'/'.join(name.split('/')[-2:])}:{f.get('line')} {f.get('name')}"
        return "?"

    peak, held = live_at_peak(events)
    groups = defaultdict(lambda: [0, 0])
    for e in held:
        g = groups[site(e)]
        g[0] += e["size"]
        g[1] += 1
    lines = [f"peak {peak / 2**20:.0f} MiB over the start, {len(held)} blocks live"]
    for where, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{size / 2**20:9.1f} MiB x{n:<4d} {where}")
    return lines


# ---------------------------------------------------------------- result files
def md_table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join("-" if v is None else str(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def write_results(bench: str, dev: torch.device, out_dir, data: dict, markdown: str,
                  plot: Callable | None = None) -> Path:
    """Write <out_dir>/<bench>_<gpu kind>.json and .md, and .png where matplotlib imports (``plot(plt)`` draws the
    figure). Returns the path without suffix."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{bench}_{gpu_kind(dev)}"
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    stem.with_suffix(".md").write_text(markdown.rstrip() + "\n")
    written = [".json", ".md"]
    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            print(f"(no PNG: matplotlib not importable: {e})")
        else:
            plot(plt)
            plt.tight_layout()
            plt.savefig(stem.with_suffix(".png"), dpi=120)
            plt.close("all")
            written.append(".png")
    print(f"wrote {stem}{{{','.join(written)}}}")
    return stem


if __name__ == "__main__":
    print(json.dumps({"commit": git_commit(), "source_sha": source_sha()}))
