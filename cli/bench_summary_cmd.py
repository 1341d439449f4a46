"""llmopt bench summary DIR: one Markdown table of a directory of reports, with ratios to a baseline run."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .ui import note

DEFAULT_BASELINE = "hf-base"  # make bench's transformers run on the base artifact


def run(directory: Annotated[Path, typer.Argument(help="Folder of NAME-cC.json reports (llmopt bench --json).")],
        baseline: Annotated[str, typer.Option("--baseline", help="Run NAME whose throughput the ratios divide by.")]
        = DEFAULT_BASELINE) -> None:
    from llmopt.stages.bench.summary import write_summary

    print(write_summary(directory, baseline))
    note(f"wrote {directory / 'summary.md'}")
