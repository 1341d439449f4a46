"""llmopt prune SOURCE -o OUT: magnitude, Wanda or SparseGPT zeros (unstructured or N:M), or
structured removal of MLP channels or whole layers."""
from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from llmopt.stages.prune.config import OPTIONS

from .options import (Calib, CalibSeqlen, Device, DType, DTypeOpt, EvalWindows, Force, Ignore, Json, NSamples, Output,
                      Seed, Source, stage_options)
from .ui import before_after_rows, human_bytes, out, run_stage

D = OPTIONS.defaults
Method = Annotated[Optional[str], typer.Option("--method", help="magnitude | wanda | sparsegpt (default wanda)")]
Sparsity = Annotated[Optional[float], typer.Option("--sparsity", help="Share of weights to zero (default 0.5).")]
Pattern = Annotated[str, typer.Option("--pattern", help="unstructured | 2:4 | 4:8 (any N:M)")]
Structured = Annotated[Optional[str], typer.Option(
    "--structured", help="mlp (with --ratio) | layers (with --drop): a smaller model, faster on any runtime")]
Ratio = Annotated[Optional[float], typer.Option("--ratio", help="--structured mlp: share of channels to remove.")]
Drop = Annotated[Optional[int], typer.Option("--drop", help="--structured layers: how many layers to remove.")]
Damp = Annotated[float, typer.Option("--damp", help="SparseGPT dampening, fraction of mean diag(H).")]


def run(source: Source, output: Output, method: Method = D.method, sparsity: Sparsity = D.sparsity,
        pattern: Pattern = D.pattern, structured: Structured = D.structured, ratio: Ratio = D.ratio, drop: Drop = D.drop,
        ignore: Ignore = D.ignore, calib: Calib = D.calib, nsamples: NSamples = D.nsamples,
        seqlen: CalibSeqlen = D.seqlen, seed: Seed = D.seed, damp: Damp = D.damp, device: Device = D.device,
        dtype: DTypeOpt = DType(D.dtype), eval_windows: EvalWindows = D.eval_windows, force: Force = False,
        json: Json = False) -> None:
    from llmopt.stages.prune.config import PruneConfig
    from llmopt.stages.prune.run import run_prune

    config = PruneConfig.from_options(stage_options(locals(), OPTIONS))
    run_stage("prune", lambda hooks: run_prune(source, output, config, force=force, hooks=hooks), json, render)


def render(art, metrics: dict) -> None:
    table = Table(title=f"pruned -> {art.path}", title_justify="left", show_header=False)
    cfg = art.manifest["config"]
    s, st = metrics.get("sparsity"), metrics.get("structured")
    if s:
        table.add_row("method / pattern", f"{s['method']} {s['pattern']}, {s['overall']:.2%} of the pruned weights "
                      "zero (smaller once compressed; not faster to serve)")
    elif st and st["kind"] == "mlp":
        table.add_row("MLP channels", f"{st['intermediate_size_before']} -> {st['intermediate_size']} "
                      f"(ratio {cfg['ratio']:g})")
    elif st:
        table.add_row("layers", f"{st['num_hidden_layers_before']} -> {st['num_hidden_layers']}, "
                      f"dropped {st['dropped_layers']}")
    table.add_row("parameters", f"{metrics['num_parameters_before']:,} -> {metrics['num_parameters']:,}")
    table.add_row("weights on disk", human_bytes(metrics["size_bytes"]))
    table.add_row("time", f"{metrics['prune_seconds']:.1f} s")
    for row in before_after_rows(metrics.get("perplexity_before_after")):
        table.add_row(*row)
    out.print(table)
