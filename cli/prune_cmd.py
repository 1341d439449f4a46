"""llmopt prune SOURCE -o OUT: magnitude, Wanda or SparseGPT zeros (unstructured or N:M), or
structured removal of MLP channels or whole layers."""
from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from .options import DType, DTypeOpt, Force, Json, Output, Source
from .ui import human_bytes, out, run_stage

Method = Annotated[Optional[str], typer.Option("--method", help="magnitude | wanda | sparsegpt (default wanda)")]
Sparsity = Annotated[Optional[float], typer.Option("--sparsity", help="Share of weights to zero (default 0.5).")]
Pattern = Annotated[str, typer.Option("--pattern", help="unstructured | 2:4 | 4:8 (any N:M)")]
Structured = Annotated[Optional[str], typer.Option(
    "--structured", help="mlp (with --ratio) | layers (with --drop): a smaller model, faster on any runtime")]
Ratio = Annotated[Optional[float], typer.Option("--ratio", help="--structured mlp: share of channels to remove.")]
Drop = Annotated[Optional[int], typer.Option("--drop", help="--structured layers: how many layers to remove.")]
Ignore = Annotated[Optional[list[str]], typer.Option("--ignore", help="Linear names/globs/re: to keep dense.")]
Calib = Annotated[str, typer.Option("--calib", help="wikitext2-valid | sharegpt | FILE | self")]
Damp = Annotated[float, typer.Option("--damp", help="SparseGPT dampening, fraction of mean diag(H).")]
EvalWindows = Annotated[int, typer.Option("--eval-windows", min=0, help="Perplexity windows before/after (0: off).")]


def run(source: Source, output: Output, method: Method = None, sparsity: Sparsity = None,
        pattern: Pattern = "unstructured", structured: Structured = None, ratio: Ratio = None, drop: Drop = None,
        ignore: Ignore = None, calib: Calib = "wikitext2-valid",
        nsamples: Annotated[int, typer.Option("--nsamples", min=1)] = 128,
        seqlen: Annotated[int, typer.Option("--seqlen", min=2)] = 2048,
        seed: Annotated[int, typer.Option("--seed")] = 0, damp: Damp = 0.01,
        device: Annotated[str, typer.Option("--device", help="cpu | cuda")] = "cpu",
        dtype: DTypeOpt = DType.auto, eval_windows: EvalWindows = 4, force: Force = False, json: Json = False) -> None:
    from llmopt.stages.model_io import parse_dtype
    from llmopt.stages.prune.run import run_prune

    config = build_config(locals())
    run_stage("prune", lambda hooks: run_prune(source, output, config, dtype=parse_dtype(dtype.value), force=force,
                                           hooks=hooks), json, render)


def build_config(o: dict):
    """The validated PruneConfig for `run`'s options (also what a recipe's prune stage takes)."""
    from llmopt.stages.calib import CalibConfig
    from llmopt.stages.prune.config import PruneConfig

    config = PruneConfig(method=o["method"], sparsity=o["sparsity"], pattern=o["pattern"], structured=o["structured"],
                         ratio=o["ratio"], drop=o["drop"], ignore=tuple(o["ignore"] or ()),
                         calib=CalibConfig(o["calib"], o["nsamples"], o["seqlen"], o["seed"]), damp=o["damp"],
                         device=o["device"], eval_windows=o["eval_windows"])
    config.validate()
    return config


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
    ba = metrics.get("perplexity_before_after")
    if ba:
        table.add_row("perplexity", f"{ba['before']:.4f} -> {ba['after']:.4f} ({ba['increase_pct']:+.2f}%), "
                      f"{ba['protocol']}")
    out.print(table)
