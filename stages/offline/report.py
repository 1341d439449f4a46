"""The offline report: one row per measured engine and source, the ratio to the transformers baseline,
token-for-token agreement, and the engine's TTFT / TPOT. Format `llmopt-bench-offline` version 1
(docs/bench.md lists the fields)."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ..artifact import now_iso, tool_version
from ..bench.metrics import describe
from .config import OfflineConfig
from .engine import EngineRun

FORMAT = "llmopt-bench-offline"
FORMAT_VERSION = 1


@dataclass
class Measured:
    """Every run of one engine on one source: EngineRuns (throughput), or ms per token per prompt (batch-1)."""

    source: str
    engine: str  # llmopt | hf
    baseline: bool = False  # the row the ratios divide by
    runs: list = field(default_factory=list)
    spec: object = None  # the engine's SpecStats of its last batch-1 run (speculative decoding), else None


def label(m: Measured, config: OfflineConfig) -> str:
    if m.engine == "llmopt":
        return "llmopt LLMEngine"
    return "transformers generate" + ("" if config.batch1 else f", static batches of {config.hf_batch_size}")


def build_report(config: OfflineConfig, measured: list[Measured], prompt_tokens: int, threads: int) -> dict:
    rows = [_batch1_row(m, config) if config.batch1 else _throughput_row(m, config) for m in measured]
    reference = next((r for r in rows if r["baseline"]), None)
    for row in rows:
        row["x_transformers"] = _ratio(row, reference, config.batch1)
    if not config.batch1:
        _agreement(measured, rows)
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "tool_version": tool_version(), "date": now_iso(),
            **config.describe(), "threads": threads, "total_input_tokens": prompt_tokens, "rows": rows}


def _throughput_row(m: Measured, config: OfflineConfig) -> dict:
    last: EngineRun = m.runs[-1]
    tokens, seconds = sum(map(len, last.outputs)), statistics.median(r.seconds for r in m.runs)
    row = {"engine": label(m, config), "source": m.source, "baseline": m.baseline, "output_tokens": tokens,
           "seconds": seconds, "seconds_all": [r.seconds for r in m.runs], "output_tok_s": tokens / seconds}
    if m.engine == "llmopt":
        for name, values in (("ttft", last.ttfts), ("tpot", last.tpots)):
            row |= {f"{stat}_{name}_ms": value for stat, value in describe(values).items()}
    return row


def _batch1_row(m: Measured, config: OfflineConfig) -> dict:
    ms = statistics.median(statistics.median(run) for run in m.runs)
    row = {"engine": label(m, config), "source": m.source, "baseline": m.baseline, "ms_per_token": ms,
           "ms_per_token_per_prompt": m.runs[-1], "tok_s": 1e3 / ms}
    if m.spec is not None and m.spec.num_draft_tokens:
        row |= {"spec_acceptance_rate": m.spec.acceptance_rate, "spec_mean_accepted_length": m.spec.mean_accepted_length}
    return row


def _ratio(row: dict, reference: dict | None, batch1: bool) -> float | None:
    if reference is None:
        return None
    if batch1:
        return reference["ms_per_token"] / row["ms_per_token"]
    return row["output_tok_s"] / reference["output_tok_s"]


def _agreement(measured: list[Measured], rows: list[dict]) -> None:
    """Sequences that came out token for token as the baseline's, and as the first source's."""
    outputs = [m.runs[-1].outputs for m in measured]
    base = next((o for m, o in zip(measured, outputs) if m.baseline), None)
    first = next((o for m, o in zip(measured, outputs) if not m.baseline), None)
    for m, row, out in zip(measured, rows, outputs):
        row["identical_to_transformers"] = None if base is None or m.baseline else _same(out, base)
        row["identical_to_first"] = None if m.baseline or out is first else _same(out, first)


def _same(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))

