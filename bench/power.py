"""nvidia-smi samples in the background, to read whether a timed GPU loop ran at the power limit.

    with PowerSampler() as smp:
        ... timed loop ...
    smp.stats()    # {"sm_mhz": median, "sm_mhz_min", "watts": median, "limit_w", "capped": fraction, "n"}
    smp.summary()  # the same as one line

Read-only queries (clock, power, enforced power limit, active clock-event reasons; bit 0x4 is the
software power cap). Where nvidia-smi is missing, stats() is empty and summary() says so.

``energy_mj()`` reads the board's total-energy counter through NVML (millijoules since the driver
loaded). ``run_sustained`` turns it into the loop's mean power over its steady part, and that into mJ per
call: at the power cap a step takes about its energy / the cap.
"""
from __future__ import annotations

import statistics
import subprocess
import threading

QUERY = "clocks.sm,power.draw,enforced.power.limit,clocks_event_reasons.active"
SW_POWER_CAP = 0x4


_NVML = []


def energy_mj(index: int = 0):
    """The GPU's total energy counter in mJ (nvmlDeviceGetTotalEnergyConsumption), or None without NVML."""
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
    if lib.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(value)):
        return None
    return float(value.value)


class PowerSampler:
    def __init__(self, period_ms: int = 100, skip_s: float = 0.5):
        self.period_ms = period_ms
        self.skip = int(skip_s * 1000 / period_ms)  # the first samples: the card still ramping
        self.rows: list[str] = []
        self.proc = None
        self.mj_per_call = None  # set by run_sustained where NVML answers

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(self.period_ms)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
        except OSError:
            return self
        self.thread = threading.Thread(target=lambda: self.rows.extend(iter(self.proc.stdout.readline, "")))
        self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.thread.join(timeout=5)

    def stats(self) -> dict:
        vals = []
        for row in self.rows[self.skip:]:
            try:
                mhz, watts, limit, reasons = (v.strip() for v in row.split(","))
                vals.append((float(mhz), float(watts), float(limit), int(reasons, 16)))
            except ValueError:
                continue
        if not vals:
            return {}
        med = lambda i: statistics.median(v[i] for v in vals)  # noqa: E731
        return {"sm_mhz": med(0), "sm_mhz_min": min(v[0] for v in vals), "watts": med(1), "limit_w": med(2),
                "capped": sum(1 for v in vals if v[3] & SW_POWER_CAP) / len(vals), "n": len(vals)}

    def summary(self) -> str:
        s = self.stats()
        if not s:
            return "no nvidia-smi samples"
        energy = "" if self.mj_per_call is None else f"; {self.mj_per_call:.1f} mJ/call (NVML energy counter)"
        return (f"{s['n']} samples: SM clock median {s['sm_mhz']:.0f} MHz (min {s['sm_mhz_min']:.0f}), power median "
                f"{s['watts']:.0f} W of a {s['limit_w']:.0f} W limit, software power cap active in {s['capped']:.0%}"
                f"{energy}")


def run_sustained(fn, seconds: float, *, idle_first: bool = True, batch: int = 10):
    """Call fn back to back for ``seconds`` (a synchronize every ``batch`` calls) while sampling.

    Returns (ms per call, the PowerSampler). idle_first: a second's pause before, so that every loop starts
    from an idle card; the sampler skips its first second (the card ramping to its limit), and so does the
    energy per call (``smp.mj_per_call``: the NVML counter's mean power from then on, times ms per call).
    """
    import time

    import torch

    fn()
    torch.cuda.synchronize()
    if idle_first:
        time.sleep(1.0)
    with PowerSampler(skip_s=1.0) as smp:
        n, t0 = 0, time.perf_counter()
        with EnergyEdges() as edges:
            while time.perf_counter() - t0 < seconds:
                for _ in range(batch):
                    fn()
                n += batch
                torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3 / n
        watts = edges.watts(since=t0 + min(1.0, seconds / 2))  # past the ramp
        if watts is not None:
            smp.mj_per_call = watts * ms
    return ms, smp


class EnergyEdges:
    """The NVML energy counter's steps, polled on a thread (a read costs about a millisecond: never in the
    timed loop). The counter advances in steps tens of ms apart, so a reading at an arbitrary moment is off
    by up to a step; the mean power between two steps' times is not."""

    def __init__(self, period_s: float = 0.002):
        import threading

        self.period_s, self.edges, self.stop = period_s, [], threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        import time

        last = energy_mj()
        while last is not None and not self.stop.is_set():
            now = energy_mj()
            if now != last:
                self.edges.append((time.perf_counter(), now))
                last = now
            time.sleep(self.period_s)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=5)

    def watts(self, since: float):
        edges = [e for e in self.edges if e[0] >= since]
        if len(edges) < 2 or edges[-1][0] <= edges[0][0]:
            return None
        return (edges[-1][1] - edges[0][1]) / (edges[-1][0] - edges[0][0]) / 1e3
