"""How many CPU threads the kernels may use, and how idle OpenMP threads wait.

A process may run on fewer CPUs than `os.cpu_count()` says: its affinity mask (taskset, a cpuset)
limits which cores it runs on, and a CPU quota (a Kubernetes CPU limit, `docker --cpus`; the cgroup's
`cpu.max`, or `cpu.cfs_quota_us` / `cpu.cfs_period_us` under cgroup v1) limits how much of them it
gets. More threads than that gives each parallel region a straggler, so `usable_cpus` takes the
smallest of the affinity count and the quota rounded up, unless `--threads` says otherwise, and names
what decided it ("2 (affinity)", "1 (cgroup cpu.max 100000/100000)", "4 (--threads)").

torch's intra-op pool and our C kernels (`cpu_native`) share one libgomp. Its idle threads spin for
about 3 ms after each parallel region by default: fast while the cores are ours (waking a sleeping
thread costs more than most regions of a decode step last), a collapse when another process is busy
on one of them (batch-1 decode from ~110 to ~3 tok/s on 2 cores). So, on CPUs we have by affinity,
`ThreadGovernor` runs one thread fewer per core that others keep busy, and back when they stop; under
a cgroup quota, where spinning spends the quota, `choose_wait_policy` asks for sleeping waiters
(OMP_WAIT_POLICY=PASSIVE). libgomp reads that once, when it loads, so the CLI calls it before anything
imports torch; a policy the user set is kept. docs/serve.md ("Threads") has the measurements.

Standard library only at import time: the CLI imports this before anything else.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
# Under a CPU quota: sleeping waiters, no spinning (a GOMP_SPINCOUNT of the user's still wins in libgomp).
PASSIVE_WAIT = {"OMP_WAIT_POLICY": "PASSIVE"}


@dataclass(frozen=True)
class ThreadCount:
    """A thread count and what decided it."""

    count: int
    reason: str  # "affinity", "cgroup cpu.max 100000/100000", "--threads"

    def __str__(self) -> str:
        return f"{self.count} ({self.reason})"


def check_threads(threads: int | None) -> None:
    """A ValueError with a one-line message for a thread count below 1 (None: detect)."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"--threads must be a whole number of at least 1 (got {threads!r})")


def usable_cpus(threads: int | None = None, *, affinity: set[int] | None = None,
                cgroup_root: Path | None = None, proc_cgroup: Path | None = None) -> ThreadCount:
    """`threads` when given (`--threads`), else the CPUs this process may use: its affinity mask, capped
    by a cgroup CPU quota rounded up. `affinity`, `cgroup_root` and `proc_cgroup` are for tests."""
    check_threads(threads)
    if threads is not None:
        return ThreadCount(threads, "--threads")
    cpus = len(affinity if affinity is not None else _affinity())
    best = ThreadCount(max(1, cpus), "affinity")
    quota = cgroup_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        limit = max(1, math.ceil(quota[1] / quota[2]))
        if limit < best.count:
            best = ThreadCount(limit, f"cgroup {quota[0]} {quota[1]}/{quota[2]}")
    return best


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def cgroup_quota(cgroup_root: Path | None = None, proc_cgroup: Path | None = None) -> tuple[str, int, int] | None:
    """The tightest CPU quota over this process's cgroup and its ancestors, as (file, quota, period) in
    microseconds; None when there is none (or no cgroup file could be read). Default paths: the module's."""
    folders = _cgroup_folders(Path(cgroup_root or CGROUP_ROOT), Path(proc_cgroup or PROC_SELF_CGROUP))
    limits = [limit for folder in folders if (limit := _read_limit(folder))]
    return min(limits, key=lambda q: q[1] / q[2], default=None)


def _cgroup_folders(root: Path, proc_cgroup: Path) -> list[Path]:
    """The folders that may hold this process's CPU limit: its own cgroup and every ancestor up to the
    root, for cgroup v2 (`0::/path`) and for v1's cpu controller (`N:cpu,cpuacct:/path`). Inside a
    container the namespace's root is the container's cgroup, so the root itself is always looked at."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    folders = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            base = root
        elif "cpu" in controllers.split(","):
            base = root / controllers if (root / controllers).is_dir() else root / "cpu"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        folders += [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return folders + [root, root / "cpu"]


def _read_limit(folder: Path) -> tuple[str, int, int] | None:
    """(file, quota, period) of a cgroup folder's CPU limit: v2 `cpu.max` ("max 100000" is none), else v1's
    `cpu.cfs_quota_us` (-1 is none) over `cpu.cfs_period_us`."""
    text = _read(folder / "cpu.max")
    if text is not None:
        fields = text.split()
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit() and int(fields[1]) > 0:
            return "cpu.max", int(fields[0]), int(fields[1])
        return None
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    if quota is not None and period is not None and quota.strip().isdigit() and period.strip().isdigit():
        if int(quota) > 0 and int(period) > 0:
            return "cpu.cfs_quota_us", int(quota), int(period)
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def choose_wait_policy(environ=None, count: ThreadCount | None = None) -> dict[str, str]:
    """Set OMP_WAIT_POLICY=PASSIVE in `environ` (default os.environ) when a cgroup CPU quota decides the
    thread count (`count`, default `usable_cpus()`), unless the user set a wait policy; returns what it set.

    Under a quota a spinning thread spends the quota itself, and once it is spent the whole process
    stops until the next period (100 ms by default). On CPUs this process has to itself (affinity, no
    quota) libgomp keeps spinning: sleeping waiters halve batch-1 decode on a quiet 2-core VM, since
    waking a thread costs more than most parallel regions last, and the `ThreadGovernor` handles a
    neighbour there. Must run before libgomp loads (before `import torch`) to take effect; child
    processes (tensor-parallel ranks) inherit it."""
    environ = os.environ if environ is None else environ
    count = usable_cpus() if count is None else count
    if not count.reason.startswith("cgroup") or "OMP_WAIT_POLICY" in environ:
        return {}
    environ.update(PASSIVE_WAIT)
    return dict(PASSIVE_WAIT)


def apply_threads(count: ThreadCount) -> ThreadCount:
    """Use `count` threads for torch's intra-op pool (and so for our C kernels, which share its libgomp)
    and its inter-op pool. torch fixes the inter-op pool at its first use; past that it is left as it is."""
    import torch

    torch.set_num_threads(count.count)
    try:
        torch.set_num_interop_threads(count.count)
    except RuntimeError:  # already started, or already set once in this process
        pass
    return count


def describe(count: ThreadCount, environ=None) -> str:
    """The start-up line: "threads: 2 (affinity), OpenMP waits PASSIVE"."""
    environ = os.environ if environ is None else environ
    return f"threads: {count}, OpenMP waits {environ.get('OMP_WAIT_POLICY', 'by libgomp default (spinning)')}"


def cpu_busy_ticks(cpus: set[int], stat: Path = Path("/proc/stat")) -> int:
    """Clock ticks `cpus` have spent busy since boot (anything but idle and iowait; steal counts: another
    guest had the core)."""
    busy = 0
    for line in stat.read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(f) for f in fields[:8]]
            busy += sum(ticks) - ticks[3] - ticks[4]
    return busy


def own_ticks(stat: Path = Path("/proc/self/stat")) -> int:
    """Clock ticks this process has run (user + system), all its threads."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


class ThreadGovernor:
    """One thread fewer for each core another process keeps busy, while it does; back up when it stops.

    With two threads and a busy neighbour on one of the two cores, every parallel region waits for the
    thread that shares its core, which runs half the time in slices of milliseconds: decode falls to a
    few tokens a second. One thread on the free core keeps the single-thread speed. The thread that runs
    the model calls `tick()` before each step; every `interval_s` it compares the busy time of the CPUs
    it may use with its own, and after two samples that agree it changes torch's thread count (for the
    calling thread, which is where the step's parallel regions start)."""

    def __init__(self, count: ThreadCount, cpus: set[int], interval_s: float = 0.5, clock=time.monotonic,
                 busy=cpu_busy_ticks, own=own_ticks, hz: int | None = None, on_change=None):
        """`on_change(threads, others)`: told each change, with the CPUs' worth of other work seen."""
        self.limit, self.cpus, self.interval_s, self.clock = count.count, set(cpus), interval_s, clock
        self.on_change = on_change
        self._busy, self._own, self.hz = busy, own, hz or os.sysconf("SC_CLK_TCK")
        self.threads, self._pending = count.count, None
        self._last = (clock(), busy(self.cpus), own())

    def others(self) -> float | None:
        """CPUs' worth of other processes' work on our CPUs since the last sample; None before `interval_s`."""
        now = self.clock()
        if now - self._last[0] < self.interval_s:
            return None
        sample = (now, self._busy(self.cpus), self._own())
        (t0, busy0, own0), self._last = self._last, sample
        return max(0.0, (sample[1] - busy0) - (sample[2] - own0)) / self.hz / (now - t0)

    def tick(self) -> int | None:
        """The new thread count when it changed in this call (torch's is set), else None."""
        others = self.others()
        if others is None:
            return None
        target = max(1, min(self.limit, self.limit - math.floor(others + 0.5)))
        if target == self.threads or target != self._pending:
            self._pending = target if target != self.threads else None
            return None
        import torch

        torch.set_num_threads(target)
        self.threads, self._pending = target, None
        if self.on_change is not None:
            self.on_change(target, others)
        return target


def governor_for(count: ThreadCount, on_change=None) -> ThreadGovernor | None:
    """A governor when this process runs threads on every CPU it may use, more than one (a neighbour then
    shares a core with one of them); None otherwise (one thread, --threads, a cgroup quota below the
    affinity mask: the kernel can move our threads to the free cores; tensor-parallel ranks, which share the
    CPUs and so run fewer threads than `count`), or where /proc cannot be read."""
    import torch

    cpus = _affinity()
    if count.reason != "affinity" or count.count < 2 or not count.count == len(cpus) == torch.get_num_threads():
        return None
    try:
        return ThreadGovernor(count, cpus, on_change=on_change)
    except (OSError, ValueError, IndexError):
        return None
