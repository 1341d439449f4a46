"""`run_profile`: measure every source on the serve engine's code path, return the JSON-able report.

Per source: load the runtime as `llmopt serve` does, allocate one ModelRunner whose cache holds
the largest point of the sweep, then prefill and decode sweeps, the per-layer and per-op
breakdowns, peak memory and the capacity plan. The machine's copy bandwidth and GEMM throughput
are measured once, first, in the same process.
"""
from __future__ import annotations

import gc
import os
import time
from collections import Counter

import torch

from ..artifact import Artifact, is_artifact, now_iso, tool_version
from ..errors import ArtifactError, ConfigError
from ..progress import StageHooks
from ..safetensors_io import load_dir
from ..serve.loader import build_runtime, locate, read_config
from ..serve.model import spec_from_config
from ..serve.runner import ModelRunner, free_memory_bytes, parse_kv_cache_memory
from ..source import resolve
from .breakdown import layer_breakdown, op_breakdown
from .capacity import PlanInputs, plan_capacity
from .config import ProfileConfig
from .costs import PROJECTIONS, kv_bytes_per_token, parameter_count, tensor_bytes, weight_bytes
from .machine import measure_machine, peak_memory, reset_peak_memory, resident_bytes, torch_threads
from .plan import SweepPlan, plan_sweep
from .steps import decode_step, prefill_step
from .sweeps import context_slope, decode_point, interleaved_seconds, prefill_point, roofline, steady_seconds

DEFAULT_BUDGET_FRACTION = 0.9


class _Progress:
    """Counts measurement points for the caller's (done, total) callback."""

    def __init__(self, hooks: StageHooks, total: int):
        self.hooks, self.done, self.total = hooks, 0, total

    def tick(self, count: int = 1) -> None:
        self.done += count
        self.hooks.window(min(self.done, self.total), self.total)


def run_profile(sources: list[str], config: ProfileConfig, hooks: StageHooks | None = None) -> dict:
    """Profile `sources` (any model source refs) with `config`; returns the report dict (see README)."""
    hooks = hooks or StageHooks()
    config.validate()
    device = preflight(sources, config)
    with torch_threads(config.threads):
        return _profile_all(sources, config, device, hooks)


def _profile_all(sources: list[str], config: ProfileConfig, device: torch.device, hooks: StageHooks) -> dict:
    per_source = len(config.prompt_lens) + len(config.batch_sizes) + len(config.context_lens) + 5
    progress = _Progress(hooks, 1 + per_source * len(sources))
    hooks.status(f"measuring copy bandwidth and GEMM throughput on {device}")
    machine = measure_machine(device, config.copy_mib)
    progress.tick()
    results = []
    for ref in sources:
        results.append(profile_source(ref, config, machine, device, hooks, progress))
        gc.collect()
    return {"tool": "llmopt profile", "version": tool_version(), "created_at": now_iso(),
            "config": config.to_dict(), "machine": machine, "sources": results, "comparison": compare(results)}


def preflight(sources: list[str], config: ProfileConfig) -> torch.device:
    """The device; fails on a missing source, or one the sweep cannot run, before minutes of measuring."""
    device = _device(config.device)
    if not sources:
        raise ConfigError("give at least one model source to profile")
    for ref in sources:
        source = resolve(ref)
        if source.kind in ("artifact", "hf"):  # config.json at hand (a GGUF's comes with its import)
            spec = spec_from_config(read_config(source.path))
            if min(config.prompt_lens) > spec.max_positions:
                raise ConfigError(f"{ref}: no --prompt-lens value fits the model's {spec.max_positions} positions")
    return device


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu")
    return device


def load_source(ref: str, config: ProfileConfig, device: torch.device):
    """(runtime, facts about the source) -- the runtime built as the serve loader builds it."""
    directory, files = locate(ref)
    model_config = read_config(directory)
    spec_from_config(model_config)  # other architectures fail before any weight is read
    if not files:
        raise ArtifactError(f"{directory}: no safetensors weights (the serve runtime loads safetensors only)")
    from ..model_io import parse_dtype

    dtype = None if config.dtype in (None, "auto") else parse_dtype(config.dtype)
    runtime = build_runtime(model_config, load_dir(directory, files), device, dtype, config.backend)
    manifest = Artifact.open(directory, verify=False).manifest if is_artifact(directory) else {}
    size = sum(os.path.getsize(directory / f) for f in files)
    return runtime, {"path": str(directory), "size_bytes": size, "stage": manifest.get("stage"),
                     "perplexity": manifest_perplexity(manifest.get("metrics", {}))}


def manifest_perplexity(metrics: dict) -> dict | None:
    """The perplexity an artifact's manifest records (after its stage, else its longest stored eval); `sets`:
    its stage's perplexity on the other evaluation sets (code, chat), where it measured them."""
    after = metrics.get("perplexity_before_after")
    if after:
        sets = {name: v["after"] for name, v in (after.get("sets") or {}).items() if name != after.get("text")}
        return {"perplexity": after["after"], "protocol": after["protocol"], "sets": sets}
    evals = [(k, v) for k, v in metrics.items()
             if k.startswith("eval/") and "/kl-vs-" not in k and isinstance(v, dict) and "perplexity" in v]
    if not evals:
        return None
    key, value = max(evals, key=lambda kv: kv[1].get("windows", 0))
    return {"perplexity": value["perplexity"], "protocol": key}


def profile_source(ref: str, config: ProfileConfig, machine: dict, device, hooks: StageHooks,
                   progress: _Progress) -> dict:
    """Every measurement of one source (see the module docstring)."""
    memory = {"free_before_bytes": free_memory_bytes(device), "before_load_bytes": resident_bytes(device) or 0}
    hooks.status(f"loading {ref}")
    start = time.perf_counter()
    runtime, facts = load_source(ref, config, device)
    memory["load_seconds"] = time.perf_counter() - start
    memory["loaded_bytes"] = max(0, (resident_bytes(device) or 0) - memory["before_load_bytes"])
    plan = plan_sweep(config, runtime.spec, runtime.dtype, free_memory_bytes(device))
    runner = ModelRunner(runtime, plan.num_blocks, config.block_size)
    reset_peak_memory(device)
    memory.update(after_cache_bytes=resident_bytes(device) or 0, kv_cache_bytes=tensor_bytes([runner.kv_cache]),
                  kv_bytes_per_token=kv_bytes_per_token(runtime.spec, runner.kv_dtype),
                  peak_method="torch.cuda.max_memory_allocated" if device.type == "cuda" else "VmHWM (peak RSS)")
    weights = weight_bytes(runtime)
    sweep = _SourceSweep(runner, plan, config, hooks, progress, ref)
    prefill, decode, contexts = sweep.latencies(weights["total"], machine["copy"]["bytes_per_s"],
                                                memory["kv_bytes_per_token"])
    steady = sweep.steady(weights["total"], machine["copy"]["bytes_per_s"], memory["kv_bytes_per_token"])
    breakdown, ops = sweep.breakdowns()
    memory["peak_bytes"] = peak_memory(device)
    capacity = plan_capacity(_plan_inputs(config, memory, weights, decode, contexts, plan))
    return {"source": ref, **facts, "model": _model_facts(runtime, runtime.spec), "weights": weights,
            "skipped": plan.skipped, "prefill": prefill, "decode": decode, "decode_context": contexts,
            "roofline": roofline(steady, machine["copy"], decode[0]), "breakdown": breakdown, "ops": ops,
            "memory": memory, "capacity": capacity}


class _SourceSweep:
    """The measurements on one runner, narrating and counting points as they finish."""

    def __init__(self, runner: ModelRunner, plan: SweepPlan, config: ProfileConfig, hooks: StageHooks,
                 progress: _Progress, ref: str):
        self.runner, self.plan, self.config, self.hooks, self.progress, self.ref = \
            runner, plan, config, hooks, progress, ref

    def _done(self, point: dict) -> dict:
        self.progress.tick()
        return point

    def latencies(self, weight_bytes: int, copy_bytes_per_s: float, kv_token: int) -> tuple[list, list, list]:
        """(prefill points, batch sweep, context sweep at batch 1)."""
        runner, plan, cfg = self.runner, self.plan, self.config
        self.hooks.status(f"{self.ref}: prefill at {', '.join(map(str, plan.prompt_lens))} tokens")
        prefill = [self._done(prefill_point(runner, n, cfg.repeats)) for n in plan.prompt_lens]

        def decode(points: list[tuple[int, int]]) -> list[dict]:
            steps = {point: decode_step(runner, *point) for point in points}
            seconds = interleaved_seconds(runner, steps, cfg.decode_steps)
            return [self._done(decode_point(runner, steps[p], seconds[p], weight_bytes, copy_bytes_per_s, kv_token))
                    for p in points]

        self.hooks.status(f"{self.ref}: decode at batch {', '.join(map(str, plan.batch_sizes))}, "
                          f"context {plan.decode_context}")
        batches = decode([(b, plan.decode_context) for b in plan.batch_sizes])
        self.hooks.status(f"{self.ref}: decode at batch 1, context {', '.join(map(str, plan.context_lens))}")
        contexts = decode([(1, c) for c in plan.context_lens])
        configured = len(cfg.prompt_lens) + len(cfg.batch_sizes) + len(cfg.context_lens)
        self.progress.tick(configured - len(prefill) - len(batches) - len(contexts))  # the skipped points
        return prefill, batches, contexts

    def steady(self, weight_bytes: int, copy_bytes_per_s: float, kv_token: int) -> dict:
        """The roofline's batch-1 step at the decode context, timed back to back."""
        step = decode_step(self.runner, 1, self.plan.decode_context)
        self.hooks.status(f"{self.ref}: batch-1 decode steps back to back (the roofline)")
        seconds = steady_seconds(self.runner, step, self.config.decode_steps)
        return self._done(decode_point(self.runner, step, seconds, weight_bytes, copy_bytes_per_s, kv_token))

    def breakdowns(self) -> tuple[dict, dict]:
        """Per-layer and per-op time of the batch-1 decode step and of the shortest prefill."""
        runner, plan, cfg = self.runner, self.plan, self.config
        steps = {"decode": (decode_step(runner, 1, plan.decode_context), max(cfg.decode_steps, cfg.profile_steps),
                            f"decode, batch 1, context {plan.decode_context}"),
                 "prefill": (prefill_step(runner, plan.prompt_lens[0]), cfg.profile_steps,
                             f"prefill, {plan.prompt_lens[0]} tokens")}
        breakdown, ops = {}, {}
        for name, (step, repeats, what) in steps.items():
            self.hooks.status(f"{self.ref}: per-layer and per-op time of the {name} step")
            breakdown[name] = {**self._done(layer_breakdown(runner, step, repeats)), "what": what}
            ops[name] = self._done(op_breakdown(runner, step, cfg.profile_steps, cfg.top_ops))
        return breakdown, ops


def _plan_inputs(config: ProfileConfig, memory: dict, weights: dict, decode: list, contexts: list,
                 plan: SweepPlan) -> PlanInputs:
    budget = parse_kv_cache_memory(config.memory_budget or DEFAULT_BUDGET_FRACTION)
    if isinstance(budget, float):
        budget = int(budget * memory["free_before_bytes"])
    return PlanInputs(
        budget_bytes=budget, weights_bytes=max(memory["loaded_bytes"], weights["total"]),
        overhead_bytes=max(0, (memory["peak_bytes"] or 0) - memory["after_cache_bytes"]),
        kv_bytes_per_token=memory["kv_bytes_per_token"], block_size=config.block_size, context=plan.plan_context,
        decode=tuple((p["batch"], p["ms"]) for p in decode), decode_context=plan.decode_context,
        decode_spread=tuple((p["batch"], p["ms_min"], p["ms_max"]) for p in decode),
        ms_per_context_token=context_slope(contexts), target_tpot_ms=config.target_tpot_ms)


def _model_facts(runtime, spec) -> dict:
    kinds = Counter(type(getattr(layer, p)).__name__ for layer in runtime.layers for p in PROJECTIONS)
    return {"architecture": spec.architecture, "num_layers": spec.num_layers, "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size, "num_heads": spec.num_heads,
            "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab_size": spec.vocab_size,
            "parameters": parameter_count(spec), "dtype": str(runtime.dtype).removeprefix("torch."),
            "projections": dict(kinds), "lm_head": type(runtime.lm_head).__name__}


def compare(results: list[dict]) -> list[dict]:
    """One row per source: size, perplexity, decode tokens/s at batch 1 and 16, bandwidth share."""
    rows = []
    for r in results:
        by_batch = {p["batch"]: p["tokens_per_s"] for p in r["decode"]}
        ppl = r["perplexity"] or {}
        rows.append({"source": r["source"], "size_bytes": r["size_bytes"], "perplexity": ppl.get("perplexity"),
                     "perplexity_protocol": ppl.get("protocol"), "perplexity_sets": ppl.get("sets") or {},
                     "decode_tokens_per_s_b1": by_batch.get(1),
                     "decode_tokens_per_s_b16": by_batch.get(16),
                     "bandwidth_share": r["roofline"]["bandwidth_share"],
                     "prefill_tokens_per_s": r["prefill"][-1]["tokens_per_s"] if r["prefill"] else None,
                     "prefill_len": r["prefill"][-1]["prompt_len"] if r["prefill"] else None})
    return rows
