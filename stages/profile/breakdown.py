"""Where a step's time goes: per decoder layer (forward hooks) and per op (torch.profiler).

Per layer: a pre-hook and a post-hook on every `runtime.layers[i]` and on the lm_head read the
clock (after a device sync on CUDA). Hooked and plain steps alternate, so machine noise hits both
alike. Each part is accounted as its share of the hooked steps it was measured in (`account_parts`):
medians taken part by part do not add up, and the hooks' own clock reads and syncs make a hooked step
slower than a plain one, which together once showed parts summing to 140 % of the step and a negative
rest. Shares of the same steps add up to at most 1 whenever the hooked modules run one after another;
they are shown in ms of the median plain step, so the parts and `unattributed_ms` (what no hook covers:
embedding, attention metadata, final norm, logits to fp32) sum to it. Parts that overlap (a hooked
module running inside another) can exceed the step: the report's `note` then says so.

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
    """While the block runs, hooks on `modules` add each call's seconds to `spent[name]`."""
    starts, handles = {}, []

    def pre(name):
        def hook(module, args):
            synchronize(device)
            starts[name] = time.perf_counter()
        return hook

    def post(name):
        def hook(module, args, output):
            synchronize(device)
            spent[name] += time.perf_counter() - starts[name]
        return hook

    for name, module in modules.items():
        handles += [module.register_forward_pre_hook(pre(name)), module.register_forward_hook(post(name))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def layer_breakdown(runner: ModelRunner, step: StepInput, steps: int) -> dict:
    """Ms per decoder layer and lm_head within the median plain step time of the same step
    (on the per-layer path; `fused_step_ms`: the same step as served)."""
    device = runner.kv_cache.device
    runtime = runner.runtime
    modules = {f"layer {i}": layer for i, layer in enumerate(runtime.layers)}
    modules["lm_head"] = runtime.lm_head
    parts, plain, hooked, served = [], [], [], []
    for _ in range(2):  # warm-up: the first calls after a change of shape set up kernels and buffers
        runner.execute(step)
        runner.execute(step, fused=False)
    for _ in range(steps):  # alternate, so noise on the shared machine hits all alike
        served.append(timed(lambda: runner.execute(step), device))
        plain.append(timed(lambda: runner.execute(step, fused=False), device))
        spent = dict.fromkeys(modules, 0.0)
        with _timing_hooks(modules, spent, device):
            hooked.append(timed(lambda: runner.execute(step, fused=False), device))
        parts.append(spent)
    return {**account_parts(parts, hooked, plain), "fused_step_ms": statistics.median(served) * 1e3,
            "steps": steps}


def account_parts(parts: list[dict], hooked: list[float], plain: list[float]) -> dict:
    """Parts as shares of the hooked steps they were timed in, in ms of the median plain step.

    `parts[i][name]`: seconds `name` took during hooked step i, which took `hooked[i]` seconds. Steps
    slower than the median hooked step are left out whole (a burst of load skews neither parts nor
    total), and the kept ones are summed, not medianed, so that the shares add up.
    """
    cut = statistics.median(hooked)
    kept = [i for i, seconds in enumerate(hooked) if seconds <= cut]
    kept_seconds = sum(hooked[i] for i in kept)
    step_ms = statistics.median(plain) * 1e3
    rows = []
    for name in parts[0]:
        share = sum(parts[i][name] for i in kept) / kept_seconds
        rows.append({"name": name, "ms": share * step_ms, "share_of_step": share,
                     "hooked_median_ms": statistics.median(p[name] for p in parts) * 1e3})
    covered = sum(r["share_of_step"] for r in rows)
    hooked_ms = cut * 1e3
    note = (f"parts are {covered:.1%} of the hooked steps they were timed in: hooked modules overlap (one runs "
            "inside another), so their time counts twice and the rest is negative") if covered > 1 else ""
    return {"rows": rows, "sum_ms": covered * step_ms, "step_ms": step_ms, "hooked_step_ms": hooked_ms,
            "hook_overhead_ms": hooked_ms - step_ms, "ratio": covered, "unattributed_ms": (1 - covered) * step_ms,
            "note": note, "ratio_formula": "ratio = sum over hooked steps of the parts' time / those steps' "
                                           "time (the steps up to the median); ms = ratio * step_ms (step_ms: "
                                           "the same step without hooks, interleaved)"}


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
