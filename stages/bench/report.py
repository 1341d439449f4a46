"""The bench report: settings, metrics and per-request samples as one JSON document.

Top-level field names follow vLLM's benchmark_serving result files where they overlap (completed,
total_input_tokens, request_throughput, mean_ttft_ms, p99_itl_ms, ..., input_lens, output_lens,
ttfts, itls, errors), so tools written for those files read ours. The README documents the schema.
"""
from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from ..errors import DataError
from .config import BenchConfig
from .dataset import DatasetConfig
from .metrics import failures, summarize, unknown_input_lengths
from .runner import BenchRun

FORMAT = "llmopt-bench"
FORMAT_VERSION = 1


def build_report(config: BenchConfig, dataset: DatasetConfig, run: BenchRun, server: dict | None = None) -> dict:
    """The whole report of a run (an interrupted run reports what finished)."""
    settings = config.describe() | {"model_id": run.model} | dataset.describe()
    header = {"format": FORMAT, "format_version": FORMAT_VERSION, "tool_version": _tool_version(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **settings,
              "server": server, "interrupted": run.interrupted, "planned": run.planned,
              "warmup_failed": run.warmup_failed, "warmup_error": run.warmup_error}
    results = run.results
    samples = {"input_lens": [r.prompt_len for r in results],
               "output_lens": [r.output_tokens if r.ok else 0 for r in results],
               "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
               "e2els": [r.e2e for r in results], "start_times": [r.start for r in results],
               "errors": [None if r.ok else f"{r.error}: {r.detail}" for r in results]}
    metrics = summarize(results, run.duration, config.slo)
    return header | metrics | {"failures": failures(results),
                               "unknown_input_lens": unknown_input_lengths(results)} | samples


def write_report(report: dict, path: Path) -> None:
    """Write atomically: a temporary sibling, then a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def load_report(path: Path) -> dict:
    """A report written by `llmopt bench --json` (or a vLLM benchmark_serving result file)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such report file")
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not JSON ({e})") from None
    if not isinstance(report, dict) or "completed" not in report:
        raise DataError(f"{path}: not a bench report (no 'completed' field); write one with llmopt bench --json")
    return report


def result_path(report: dict, directory: Path | None = None, filename: str | None = None) -> Path:
    """Where vLLM's --save-result writes: --result-dir (default: here) / --result-filename, or a name made of
    the rate, the concurrency, the model and the time (llmopt-4.0qps-concurrency8-MODEL-20261206-043000.json)."""
    if filename is None:
        concurrency = f"-concurrency{report['max_concurrency']}" if report.get("max_concurrency") else ""
        model = str(report.get("model_id") or "model").rstrip("/").rsplit("/", 1)[-1]
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        filename = f"llmopt-{report.get('request_rate')}qps{concurrency}-{model}-{stamp}.json"
    return Path(directory or ".") / filename


def token_times(report: dict) -> list[float]:
    """When each streamed token arrived, in seconds after the start (rebuilt from the samples)."""
    times = []
    for start, ttft, itl in zip(report.get("start_times", []), report.get("ttfts", []), report.get("itls", [])):
        if ttft is None:
            continue
        t = start + ttft
        times.append(t)
        for gap in itl or []:
            t += gap
            times.append(t)
    return times


def _tool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llmopt")
    except PackageNotFoundError:
        return "unknown"
