"""The machine's own limits, measured in the same run as the model: memory bandwidth (a copy
benchmark, the decode roofline's ceiling) and dense matmul throughput (the prefill ceiling)."""
from __future__ import annotations

import platform
from contextlib import contextmanager
import time

import torch

from llmopt.kernels.threads import apply_threads, usable_cpus

HOST = torch.device("cpu")  # where the process's resident set is read, whatever device computes


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings cover it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Seconds one call of `fn` takes, device work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def copy_bandwidth(device: torch.device, mib: int = 256, repeats: int = 7) -> dict:
    """Bytes per second of `dst.copy_(src)` over a buffer far larger than the caches.

    STREAM convention: a copy of N bytes moves 2N (N read + N written). The fastest of `repeats`
    copies (on CUDA, of `repeats` averages of 10 copies) after one warm-up copy (which also faults the
    pages in): a ceiling, so the best the machine did, which other processes on a shared machine can
    only lower.
    """
    n = mib << 20
    src = torch.ones(n // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = min(_copy_seconds(src, dst, device) for _ in range(repeats))
    moved = 2 * src.numel() * src.element_size()
    return {"buffer_bytes": n, "bytes_moved_per_copy": moved, "seconds_best": seconds,
            "bytes_per_s": moved / seconds, "repeats": repeats,
            "convention": "STREAM copy: bytes read + bytes written per second"}


def _copy_seconds(src: torch.Tensor, dst: torch.Tensor, device: torch.device, copies: int = 10) -> float:
    """Seconds of one copy. On CUDA, events around `copies` back-to-back copies: a single copy of a few
    hundred MiB takes about 100 us there, which a host-side timer's launch and sync would inflate."""
    if device.type != "cuda":
        return timed(lambda: dst.copy_(src), device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(copies):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3 / copies


def gemm_throughput(device: torch.device, dtype: torch.dtype, n: int = 1024, repeats: int = 7,
                    budget_s: float = 1.0) -> float:
    """FLOP/s of an n x n x n matmul in `dtype`: the fastest of `repeats` after a warm-up (a ceiling), or of
    as many as `budget_s` seconds allow, at least one (a CPU without a bf16 GEMM takes seconds a call)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < repeats and (not times or time.perf_counter() < deadline):
        times.append(timed(lambda: torch.mm(a, b), device))
    return 2 * n ** 3 / min(times)


def describe(device: torch.device) -> dict:
    """What the numbers were measured on."""
    info = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def measure_machine(device: torch.device, copy_mib: int) -> dict:
    """Machine description, copy bandwidth, and fp32/bf16 GEMM FLOP/s."""
    n = 4096 if device.type == "cuda" else 1024  # a GPU needs a larger matmul to approach its peak
    gemm = {name: gemm_throughput(device, dtype, n) for name, dtype in (("fp32", torch.float32),
                                                                         ("bf16", torch.bfloat16))}
    return {**describe(device), "copy": copy_bandwidth(device, copy_mib), "gemm_flops_per_s": gemm, "gemm_size": n}


def _proc_status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def resident_bytes(device: torch.device) -> int | None:
    """Memory the process holds now: CUDA allocated bytes, or the resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _proc_status_bytes("VmRSS")


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak window (CUDA stats, or Linux's VmHWM via clear_refs); False if not possible."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory(device: torch.device) -> int | None:
    """Peak bytes since the last reset: CUDA max allocated, or the peak resident set (VmHWM)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _proc_status_bytes("VmHWM")


@contextmanager
def torch_threads(threads: int | None):
    """Yields the thread count in force: `threads`, or the CPUs this process may use (affinity, cgroup quota:
    `llmopt.kernels.threads`, as `llmopt serve` uses); the caller's count is restored after."""
    before = torch.get_num_threads()
    apply_threads(usable_cpus(threads))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
