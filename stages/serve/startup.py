"""The start-up report of a serving process: how long each phase took from the process's start until
the server was ready (`/health` 200), logged in the "serving on" line and kept for tests.

Phases, in order (only those that ran are listed):
- imports: from the process's start (the kernel's record of it, `/proc/self/stat`) to the end of the
  serve command's imports (torch, the HTTP stack, the engine's modules). The model loads after them, not
  beside them: both are Python holding the GIL, and a load thread whose torch calls release it waits a
  switch interval (5 ms) each time to get it back from an importing thread (its layouts phase took 0.3 s
  instead of 0.04 here);
- http: building the app and binding the port (the model loads in a thread started once it is bound);
- artifact: resolving the source and checking the artifact (`stages/artifact.py: Artifact.open`);
- tokenizer, weights (memory-mapping the safetensors files), layouts (building every projection's kernel
  layouts, or reading them from the layout cache), kv_cache (mapping it; `serve` makes its pages resident
  once ready), engine (the fused decode step, the scheduler);
- after ready, in the background (`StartupReport.on_ready`): the KV cache's pages made resident, then
  oneDNN's per-shape primitives built (reported on a line of their own).

Each phase records wall seconds and the process's CPU seconds (user + system, all threads) spent in it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager, nullcontext

log = logging.getLogger("llmopt.serve")


def process_age() -> float | None:
    """Seconds since this process started, from the kernel's start time; None where procfs is missing."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


ORDER = ("imports", "http", "artifact", "tokenizer", "weights", "layouts", "kv_cache", "engine")


class StartupReport:
    """Phases of one start-up, each (wall s, CPU s). `start`: the perf_counter reading the process started
    at (default: from `process_age`, else now)."""

    def __init__(self, start: float | None = None):
        now = time.perf_counter()
        age = process_age() if start is None else None
        self.start = start if start is not None else now - (age or 0.0)
        self.phases: dict[str, tuple[float, float]] = {}
        self.notes: dict[str, str] = {}  # what a phase found (the layout cache: hit / miss / rebuilt)
        self.ready_at: float | None = None
        self._lock = threading.Lock()
        self._mark_wall, self._mark_cpu = self.start, 0.0  # `mark` measures from the process's start
        self._on_ready: list = []

    def add(self, name: str, wall: float, cpu: float = 0.0) -> None:
        with self._lock:
            old = self.phases.get(name, (0.0, 0.0))
            self.phases[name] = (old[0] + wall, old[1] + cpu)

    @contextmanager
    def phase(self, name: str):
        """Time the block as phase `name` (added to an earlier one of the same name)."""
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - wall, time.process_time() - cpu)

    def mark(self, name: str) -> None:
        """Phase `name` = from the previous mark (or the process's start) until now."""
        wall, cpu = time.perf_counter(), time.process_time()
        self.add(name, wall - self._mark_wall, cpu - self._mark_cpu)
        self._mark_wall, self._mark_cpu = wall, cpu

    def ready(self) -> None:
        """The server answers /health 200 from now on; then what `on_ready` deferred until now runs."""
        self.ready_at = time.perf_counter()
        self.cpu_at_ready = time.process_time()
        with self._lock:
            deferred, self._on_ready = self._on_ready, []
        for call in deferred:
            try:
                call()
            except Exception as e:  # deferred work is an optimisation: the server serves without it
                log.warning("after start-up: %s failed (%s: %s)", getattr(call, "__name__", call), type(e).__name__, e)

    def on_ready(self, call) -> None:
        """Run `call()` once the server is ready (work that would only delay it: caches, warm-up threads)."""
        with self._lock:
            self._on_ready.append(call)

    @property
    def ready_s(self) -> float | None:
        return None if self.ready_at is None else self.ready_at - self.start

    def ordered(self) -> list[tuple[str, tuple[float, float]]]:
        """The phases in start-up order (the load runs in a thread of its own: its phases may be recorded
        before the imports end), unknown names last."""
        rank = {name: i for i, name in enumerate(ORDER)}
        return sorted(self.phases.items(), key=lambda item: rank.get(item[0], len(ORDER)))

    def as_dict(self) -> dict:
        """{"ready_s", "cpu_s", "phases": {name: {"wall_s", "cpu_s"}}, "notes"} (JSON-able)."""
        return {"ready_s": _round(self.ready_s), "cpu_s": _round(getattr(self, "cpu_at_ready", None)),
                "phases": {n: {"wall_s": _round(w), "cpu_s": _round(c)} for n, (w, c) in self.ordered()},
                "notes": dict(self.notes)}

    def summary(self) -> str:
        """'ready in 1.42 s (cpu 1.90 s): imports 0.61, http 0.02, ...; layouts: cache hit'."""
        parts = ", ".join(f"{n} {w:.2f}" for n, (w, _) in self.ordered())
        notes = "".join(f"; {n}: {v}" for n, v in self.notes.items())
        head = f"ready in {self.ready_s:.2f} s (cpu {self.cpu_at_ready:.2f} s)" if self.ready_at is not None \
            else "start-up"
        return f"{head}: {parts}{notes}"


def phase(report: "StartupReport | None", name: str):
    """`report.phase(name)`, or nothing without a report."""
    return nullcontext() if report is None else report.phase(name)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
