"""llmopt profile SOURCE [SOURCE ...]: latency, roofline, per-layer/op time, memory and capacity on
the serve engine's code path, as tables, --json FILE and a self-contained --html FILE."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from llmopt.stages.profile.config import OPTIONS

from .options import stage_options
from .ui import note, out, progress_bar

D = OPTIONS.defaults
Sources = Annotated[list[str], typer.Argument(help="Model sources (artifact, HF dir, .gguf, alias) to compare.")]
Ints = Optional[str]


def _opt(name: str, help: str):
    return typer.Option(name, help=help)


def run(sources: Sources,
        quick: Annotated[bool, _opt("--quick", "A short sweep (about a minute per source on 2 CPU cores).")] = D.quick,
        json_file: Annotated[Optional[Path], _opt("--json", "Write the full report as JSON to FILE.")] = None,
        html_file: Annotated[Optional[Path], _opt("--html", "Write a self-contained HTML report to FILE.")] = None,
        prompt_lens: Annotated[Ints, _opt("--prompt-lens", "Prefill prompt lengths, e.g. 128,512,2048.")] = D.prompt_lens,
        batch_sizes: Annotated[Ints, _opt("--batch-sizes", "Decode batch sizes (must include 1).")] = D.batch_sizes,
        context_lens: Annotated[Ints, _opt("--context-lens", "Decode contexts at batch 1.")] = D.context_lens,
        decode_context: Annotated[Optional[int], _opt("--decode-context", "Context of the batch sweep.")] = D.decode_context,
        decode_steps: Annotated[Optional[int], _opt("--decode-steps", "Decode steps timed per point.")] = D.decode_steps,
        repeats: Annotated[Optional[int], _opt("--repeats", "Prefill timings per length.")] = D.repeats,
        device: Annotated[str, _opt("--device", "cpu | cuda")] = D.device,
        dtype: Annotated[Optional[str], _opt("--dtype", "auto | fp32 | bf16 | fp16")] = D.dtype,
        threads: Annotated[Optional[int], _opt("--threads", "torch threads (default: torch's).")] = D.threads,
        memory_budget: Annotated[Optional[str], _opt("--memory-budget", "Planner: 8GiB, or 0.9 of free.")] = D.memory_budget,
        plan_context: Annotated[Optional[int], _opt("--plan-context", "Planner: tokens per sequence.")] = D.plan_context,
        target_tpot_ms: Annotated[Optional[float], _opt("--target-tpot-ms", "Planner: latency target.")] = D.target_tpot_ms,
        per_layer: Annotated[bool, _opt("--per-layer", "Print every layer's row in the terminal.")] = False) -> None:
    from llmopt.stages.profile.config import ProfileConfig
    from llmopt.stages.profile.html import check_output_path, write_report
    from llmopt.stages.profile.run import preflight, run_profile
    from llmopt.stages.progress import StageHooks

    config = ProfileConfig.from_options(stage_options(locals(), OPTIONS))
    check_output_path(json_file, "--json")
    check_output_path(html_file, "--html")
    preflight(sources, config)
    with progress_bar("profile") as update:
        report = run_profile(sources, config, StageHooks(status=note, window=update))
    write_report(report, json_file, html_file)
    render(report, per_layer)
    for path in (json_file, html_file):
        if path is not None:
            note(f"wrote {path}")


def render(report: dict, per_layer: bool) -> None:
    from llmopt.stages.profile.tables import comparison_table, machine_table, source_tables

    tables = [machine_table(report)]
    for s in report["sources"]:
        tables += source_tables(s, per_layer)
    for t in tables + [comparison_table(report)]:
        table = Table(*t.columns, title=t.title, title_justify="left", caption=t.note or None,
                      caption_justify="left")
        for row in t.rows:
            table.add_row(*row)
        out.print(table)
