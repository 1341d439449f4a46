"""Capacity planner: how many sequences fit a memory budget at a context length, what each batch
size costs in latency, and which `--max-num-seqs` meets a per-token latency target. Pure arithmetic
on measured numbers; every formula is stored next to its result.

A decode step of more sequences does more work, so its time cannot fall as the batch grows. A sweep
where a smaller batch is slower than a larger one beyond both points' spread (its fastest step slower
than the larger batch's slowest) measured the machine's load, not the model: it is flagged and no
`--max-num-seqs` is recommended from it."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .steps import blocks_for


@dataclass(frozen=True)
class PlanInputs:
    budget_bytes: int  # memory for weights, runtime overhead and the KV cache together
    weights_bytes: int  # what loading the model added to memory
    overhead_bytes: int  # activations and workspaces at the measured peak, beyond the loaded weights
    kv_bytes_per_token: int
    block_size: int
    context: int  # tokens each sequence may hold (prompt + output)
    decode: tuple  # ((batch, ms per step at decode_context), ...)
    decode_context: int
    ms_per_context_token: float  # extra step time per cached token of one sequence (batch-1 fit)
    target_tpot_ms: float | None = None
    decode_spread: tuple = ()  # ((batch, fastest ms, slowest ms), ...); a batch not here: no spread known


def tpot_at(inputs: PlanInputs, batch: int, measured_ms: float) -> float:
    """Step time at the plan context: measured + batch * slope * (context - measured context)."""
    return measured_ms + batch * inputs.ms_per_context_token * (inputs.context - inputs.decode_context)


def plan_capacity(inputs: PlanInputs) -> dict:
    """Fit, trade-off table and recommendation (see the module docstring)."""
    per_seq = blocks_for(inputs.context, inputs.block_size) * inputs.block_size * inputs.kv_bytes_per_token
    kv_budget = inputs.budget_bytes - inputs.weights_bytes - inputs.overhead_bytes
    max_seqs = max(0, kv_budget // per_seq)
    spread = {batch: (low, high) for batch, low, high in inputs.decode_spread}
    rows = []
    for batch, ms in sorted(inputs.decode):
        tpot = tpot_at(inputs, batch, ms)
        low, high = spread.get(batch, (ms, ms))
        rows.append({"batch": batch, "measured_ms": ms, "measured_ms_min": low, "measured_ms_max": high,
                     "tpot_ms": tpot, "tokens_per_s": batch / tpot * 1e3, "fits": batch <= max_seqs})
    problems = non_monotone(rows)
    recommended, reason = recommend(rows, max_seqs, inputs.target_tpot_ms)
    if problems:
        recommended, reason = None, ("none: the batch sweep is not monotone beyond its noise (the machine's "
                                     "load, not the model); measure again on a quieter machine, or with more "
                                     "--decode-steps")
    return {"budget_bytes": inputs.budget_bytes, "weights_bytes": inputs.weights_bytes,
            "overhead_bytes": inputs.overhead_bytes, "kv_budget_bytes": kv_budget, "context": inputs.context,
            "kv_bytes_per_seq": per_seq, "max_num_seqs_fit": max_seqs, "tradeoff": rows,
            "target_tpot_ms": inputs.target_tpot_ms, "recommended_max_num_seqs": recommended, "reason": reason,
            "monotone": not problems, "sweep_problems": problems,
            "formulas": {
                "kv_bytes_per_seq": "ceil(context / block_size) * block_size * kv_bytes_per_token",
                "max_num_seqs_fit": "(budget - weights - overhead) // kv_bytes_per_seq",
                "tpot_ms": f"measured_ms(batch, context {inputs.decode_context}) + batch * "
                           f"{inputs.ms_per_context_token:.3g} ms/token * (context - {inputs.decode_context})"}}


def non_monotone(rows: list[dict]) -> list[str]:
    """Each pair of batches (by size) where the smaller one's fastest step is slower than the larger one's
    slowest step: a drop in step time beyond both points' spread."""
    return [f"batch {lo['batch']} ({lo['measured_ms_min']:,.2f} ms at its fastest) is slower than batch "
            f"{hi['batch']} ({hi['measured_ms_max']:,.2f} ms at its slowest)"
            for i, lo in enumerate(rows) for hi in rows[i + 1:] if lo["measured_ms_min"] > hi["measured_ms_max"]]


def recommend(rows: list[dict], max_seqs: int, target: float | None) -> tuple[int | None, str]:
    """The largest batch under `target` (interpolated between measured batches), capped by memory;
    without a target, the measured batch with the best throughput that fits."""
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        return None, f"not even the smallest measured batch fits the budget ({max_seqs} sequences)"
    if target is None:
        best = max(fitting, key=lambda r: r["tokens_per_s"])
        return best["batch"], f"best measured throughput that fits ({best['tokens_per_s']:.1f} tok/s)"
    if rows[0]["tpot_ms"] > target:
        return None, f"batch {rows[0]['batch']} already takes {rows[0]['tpot_ms']:.1f} ms per token > {target:g} ms"
    best = rows[0]["batch"]
    for lo, hi in zip(rows, rows[1:]):
        if hi["tpot_ms"] <= target:
            best = hi["batch"]
            continue
        share = (target - lo["tpot_ms"]) / (hi["tpot_ms"] - lo["tpot_ms"])
        best = lo["batch"] + math.floor(share * (hi["batch"] - lo["batch"]))
        break
    capped = min(best, max_seqs)
    why = "memory" if capped < best else "the latency target"
    if capped == rows[-1]["batch"] and rows[-1]["tpot_ms"] <= target:
        why = "the largest measured batch; measure larger ones with --batch-sizes"
    return capped, f"largest batch within {target:g} ms per token and the memory budget (bound by {why})"
