"""`llmopt profile --acceptance DIR`: the GPU check's PASS/FAIL table, from the reports `scripts/gpu_check.sh`
leaves in DIR (file names in REPORTS), against the bars in BARS.

Every figure is a median from the check's own run: the kernel speed table (`--kernel-speed`), the engine on
32 synthetic Llama-3-8B layers in bf16 and W4A16 (`--synthetic`), the end-to-end bench reports, the greedy
check (`--check-greedy`), and pytest's JUnit XML for the kernel tests and the CUDA-graph tests. A report that
is missing (its part failed or ran out of time) fails its rows; only the CUDA-graph row may say "not run"
(no such tests in the tree, or none selected). The check passes when no row fails.
"""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

from ..errors import ConfigError
from .tables import TableData

REPORTS = {  # what scripts/gpu_check.sh writes into its output folder
    "kernel_tests": "kernel-tests.xml", "kernels": "kernels.json", "engine_bf16": "engine-bf16.json",
    "engine_w4a16": "engine-w4a16.json", "bench_c1": "bench-c1.json", "bench_c32": "bench-c32.json",
    "greedy": "greedy.json", "graphs": "graphs.xml",
}
BARS = {
    "w4a16_m1_share": 0.60,  # of the copy bandwidth, the wide matrix (hidden x intermediate)
    "w4a16_m1_speedup": 2.5,  # over the dense matmul (cuBLAS fp16)
    "w4a16_m16_speedup": 2.0,
    "w4a16_m64_speedup": 1.0,  # not slower
    "w8a16_m1_share": 0.60,
    "engine_b1_share": 0.65,  # bf16, 32 layers, batch 1
    "engine_bmax_share": 0.60,  # bf16, the largest batch (128)
    "engine_w4a16_speedup": 2.5,  # W4A16 batch-1 tokens/s over bf16's
}
PASS, FAIL, NOT_RUN = "PASS", "FAIL", "not run"


def read_junit(path: Path) -> dict:
    """{tests, failures, errors, skipped} summed over a pytest JUnit XML file's test suites."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}


def load_reports(folder: Path) -> dict[str, dict | None]:
    """Each of REPORTS read from `folder` (None where missing or unreadable)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"--acceptance {folder}: no such folder (give the GPU check's output folder)")
    reports = {}
    for key, name in REPORTS.items():
        path = folder / name
        try:
            reports[key] = read_junit(path) if name.endswith(".xml") else json.loads(path.read_text())
        except (OSError, ValueError, ET.ParseError):
            reports[key] = None
    return reports


def row(check: str, bar: str, value: str, ok: bool | None) -> dict:
    """ok None: not run."""
    return {"check": check, "bar": bar, "value": value, "status": NOT_RUN if ok is None else PASS if ok else FAIL}


def missing(check: str, bar: str, name: str) -> dict:
    return row(check, bar, f"no {name} (the part failed or timed out)", False)


def tests_row(check: str, junit: dict | None, name: str, optional: bool = False) -> dict:
    if junit is None or (optional and junit["tests"] == junit["skipped"]):
        return row(check, "0 failed", "no tests ran", None) if optional else missing(check, "0 failed", name)
    failed = junit["failures"] + junit["errors"]
    value = (f"{junit['tests'] - failed - junit['skipped']} passed, {junit['failures']} failed, {junit['errors']} "
             f"errors, {junit['skipped']} skipped")
    return row(check, "0 failed", value, failed == 0 and junit["tests"] > junit["skipped"])


def kernel_rows(report: dict | None) -> list[dict]:
    """The quantized matmul bars on the wide matrix (the largest N) of the kernel speed table."""
    specs = [("w4a16", 1, "share"), ("w4a16", 1, "speedup"), ("w4a16", 16, "speedup"), ("w4a16", 64, "speedup"),
             ("w8a16", 1, "share")]
    wide = max(report["matmuls"], key=lambda r: r["n"]) if report else None
    rows = []
    for scheme, m, what in specs:
        limit = BARS[f"{scheme}_m{m}_{what}"]
        bar = f">= {limit:.0%} of copy bandwidth" if what == "share" else f">= {limit:g}x dense"
        shape = f" {wide['k']}x{wide['n']}" if wide else ""
        measure = "share of copy bandwidth" if what == "share" else "speed-up over dense"
        check = f"{scheme.upper()} M={m}{shape}: {measure}"
        if wide is None:
            rows.append(missing(check, bar, REPORTS["kernels"]))
            continue
        r = next((r for r in report["matmuls"] if r["n"] == wide["n"] and r["k"] == wide["k"] and r["m"] == m), None)
        if r is None:
            rows.append(row(check, bar, f"no row for M={m}", False))
            continue
        value = f"{r[what][scheme]:.0%}" if what == "share" else f"{r[what][scheme]:.2f}x"
        rows.append(row(check, bar, f"{value} ({r['us'][scheme]:.1f} us, dense {r['us']['dense']:.1f} us)",
                        r[what][scheme] >= limit))
    return rows


def _engine_row(report: dict, batch: int) -> dict | None:
    return next((r for r in report["rows"] if r["batch"] == batch), None)


def engine_rows(bf16: dict | None, w4a16: dict | None) -> list[dict]:
    rows = []
    for batch, key in ((1, "engine_b1_share"), (None, "engine_bmax_share")):
        bar = f">= {BARS[key]:.0%} of copy bandwidth"
        if bf16 is None:
            rows.append(missing(f"engine bf16 batch {batch or 'max'}: share", bar, REPORTS["engine_bf16"]))
            continue
        batch = batch or max(r["batch"] for r in bf16["rows"])
        r = _engine_row(bf16, batch)
        check = f"engine {bf16['layers']} layers bf16 batch {batch}: share of copy bandwidth"
        rows.append(row(check, bar, "no such batch", False) if r is None else
                    row(check, bar, f"{r['share']:.0%} ({r['step_ms']:.2f} ms/step, {r['tokens_per_s']:.1f} tok/s)",
                        r["share"] >= BARS[key]))
    bar, check = f">= {BARS['engine_w4a16_speedup']:g}x bf16", "engine W4A16 batch 1: tok/s over bf16"
    dense, quant = bf16 and _engine_row(bf16, 1), w4a16 and _engine_row(w4a16, 1)
    if dense is None or quant is None:
        name = REPORTS["engine_w4a16"] if quant is None else REPORTS["engine_bf16"]
        return rows + [missing(check, bar, f"batch-1 row in {name}")]
    ratio = quant["tokens_per_s"] / dense["tokens_per_s"]
    value = f"{ratio:.2f}x ({quant['tokens_per_s']:.1f} vs {dense['tokens_per_s']:.1f} tok/s)"
    return rows + [row(check, bar, value, ratio >= BARS["engine_w4a16_speedup"])]


def bench_row(concurrency: int, report: dict | None) -> dict:
    check, bar = f"end to end (quantize, serve, bench) at concurrency {concurrency}", "every request OK"
    if report is None:
        return missing(check, bar, REPORTS[f"bench_c{concurrency}"])
    completed, failed = report.get("completed", 0), report.get("failed", 0)
    value = f"{completed} completed, {failed} failed, {report.get('output_throughput', 0):.1f} output tok/s"
    return row(check, bar, value, completed > 0 and failed == 0)


def greedy_row(report: dict | None) -> dict:
    check, bar = "greedy tokens against CPU fp32 (tiny model)", "equal but at near-ties"
    if report is None:
        return missing(check, bar, REPORTS["greedy"])
    check = f"greedy tokens, {report['machine']['device']} {report['dtype'].removeprefix('torch.')} against CPU fp32"
    differ = [r for r in report["rows"] if r["same"] < report["tokens"]]
    value = (f"{report['exact']} of {len(report['rows'])} prompts equal throughout, {len(differ)} part at a gap "
             f"below {report['margin']:g}" if report["passed"] else
             f"{sum(not r['ok'] for r in report['rows'])} prompt(s) differ where no near-tie explains it")
    return row(check, bar, value, report["passed"])


def evaluate(reports: dict[str, dict | None]) -> list[dict]:
    """Every row of the table, from the reports `load_reports` read (a key may be absent: missing)."""
    get = reports.get
    return [tests_row("kernel tests (pytest tests/kernels)", get("kernel_tests"), REPORTS["kernel_tests"]),
            *kernel_rows(get("kernels")), *engine_rows(get("engine_bf16"), get("engine_w4a16")),
            bench_row(1, get("bench_c1")), bench_row(32, get("bench_c32")), greedy_row(get("greedy")),
            tests_row("CUDA-graph replay equals eager", get("graphs"), REPORTS["graphs"], optional=True)]


def run_acceptance(folder: str) -> dict:
    rows = evaluate(load_reports(Path(folder)))
    return {"tool": "llmopt profile --acceptance", "folder": str(folder), "bars": BARS, "rows": rows,
            "passed": all(r["status"] != FAIL for r in rows)}


def acceptance_tables(report: dict) -> list[TableData]:
    t = TableData("acceptance", f"GPU check against its bars ({report['folder']})",
                  ["check", "bar", "measured", "result"])
    t.rows = [[r["check"], r["bar"], r["value"], r["status"]] for r in report["rows"]]
    failed = sum(r["status"] == FAIL for r in report["rows"])
    t.note = "PASSED" if report["passed"] else f"FAILED: {failed} of {len(report['rows'])} rows"
    return [t]
