"""Where a step's time goes: per decoder layer (forward hooks) and per op (torch.profiler).

Per layer: a pre-hook and a post-hook on every `runtime.layers[i]` and on the lm_head read the
clock (after a device sync on CUDA). Hooked and plain steps alternate, so machine noise hits both
alike, and medians keep one slow step from skewing either; `ratio` = (sum of the parts' medians) /
(median plain step time). What no hook covers (embedding, attention metadata, final norm, logits
to fp32) is reported as `unattributed_ms`, not hidden.

A CPU decode step of few sequences normally runs every decoder layer in one native call (the backend's
fused decode step), which no hook or profiler sees into. The breakdowns therefore run the per-layer
path (`runner.execute(step, fused=False)`), which calls the same kernels in the same order one by one;
`fused_step_ms` reports the step as served (median, interleaved with the others) beside it.
"""
from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager

import torch

from ..serve.batch import StepInput
from ..serve.runner import ModelRunner
from .machine import synchronize, timed


@contextmanager
def _timing_hooks(modules: dict, spent: dict, device: torch.device):
    """While the block runs, hooks on `modules` append each call's seconds to `spent[name]`."""
    starts, handles = {}, []

    def pre(name):
        def hook(module, args):
            synchronize(device)
            starts[name] = time.perf_counter()
        return hook

    def post(name):
        def hook(module, args, output):
            synchronize(device)
            spent[name].append(time.perf_counter() - starts[name])
        return hook

    for name, module in modules.items():
        handles += [module.register_forward_pre_hook(pre(name)), module.register_forward_hook(post(name))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def layer_breakdown(runner: ModelRunner, step: StepInput, steps: int) -> dict:
    """Median ms per decoder layer and lm_head against the median plain step time of the same step
    (on the per-layer path; `fused_step_ms`: the same step as served)."""
    device = runner.kv_cache.device
    runtime = runner.runtime
    modules = {f"layer {i}": layer for i, layer in enumerate(runtime.layers)}
    modules["lm_head"] = runtime.lm_head
    spent = {name: [] for name in modules}
    plain, hooked, served = [], [], []
    for _ in range(2):  # warm-up: the first calls after a change of shape set up kernels and buffers
        runner.execute(step)
        runner.execute(step, fused=False)
    for _ in range(steps):  # alternate, so noise on the shared machine hits all alike
        served.append(timed(lambda: runner.execute(step), device))
        plain.append(timed(lambda: runner.execute(step, fused=False), device))
        with _timing_hooks(modules, spent, device):
            hooked.append(timed(lambda: runner.execute(step, fused=False), device))
    rows = [{"name": name, "ms": statistics.median(spent[name]) * 1e3} for name in modules]
    total = sum(r["ms"] for r in rows)
    step_ms = statistics.median(plain) * 1e3
    for r in rows:
        r["share_of_step"] = r["ms"] / step_ms
    return {"rows": rows, "sum_ms": total, "step_ms": step_ms, "hooked_step_ms": statistics.median(hooked) * 1e3,
            "fused_step_ms": statistics.median(served) * 1e3,
            "ratio": total / step_ms, "unattributed_ms": step_ms - total, "steps": steps,
            "ratio_formula": "ratio = sum_ms / step_ms (step_ms: the same step without hooks, interleaved)"}


def op_breakdown(runner: ModelRunner, step: StepInput, steps: int, top: int) -> dict:
    """The `top` ops by self time per step under torch.profiler (CPU time; device time on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    # Before kineto's first start: otherwise it prints "USDT: profiler_start" lines on stderr per trace.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    device = runner.kv_cache.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    runner.execute(step, fused=False)  # warm-up outside the trace
    with profile(activities=activities) as prof:
        for _ in range(steps):
            runner.execute(step, fused=False)
        synchronize(device)
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr) > 0]
    total_us = sum(getattr(e, attr) for e in events)
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    rows = [{"op": e.key, "calls_per_step": e.count / steps, "ms_per_step": getattr(e, attr) / steps / 1e3,
             "share": getattr(e, attr) / total_us} for e in events[:top]]
    return {"rows": rows, "total_ms_per_step": total_us / steps / 1e3, "steps": steps, "clock": attr,
            "ops_total": len(events)}
