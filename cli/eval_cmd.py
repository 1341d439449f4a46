"""llmopt eval SOURCE: perplexity (and KL vs --ref) with the GPTQ-style window protocol."""
from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from llmopt.stages.eval.config import OPTIONS

from .options import DType, DTypeOpt, Json, MaxWindows, Seqlen, Source, stage_options
from .ui import note, out, print_json, progress_bar

D = OPTIONS.defaults


def run(source: Source,
        text: Annotated[str, typer.Option("--text", help="wikitext2, wikitext2-valid, or a text file.")] = D.text,
        seqlen: Seqlen = D.seqlen, max_windows: MaxWindows = D.max_windows,
        ref: Annotated[Optional[str], typer.Option("--ref", help="Reference source for mean KL divergence.")] = D.ref,
        dtype: DTypeOpt = DType(D.dtype),
        runtime: Annotated[str, typer.Option("--runtime", help="What computes the logits: transformers, or serve "
                                             "(llmopt's serve runtime and kernels).")] = D.runtime,
        store: Annotated[bool, typer.Option("--store/--no-store", help="Save the result in the artifact's manifest.")] = True,
        json: Json = False) -> None:
    from llmopt.stages.eval.config import EvalConfig
    from llmopt.stages.eval.run import run_eval
    from llmopt.stages.progress import StageHooks
    from llmopt.stages.source import resolve

    config = EvalConfig.from_options(stage_options(locals(), OPTIONS))  # a missing text fails before the load
    for name in filter(None, (source, config.ref)):
        resolve(name)  # so does a wrong path or alias, before the progress display starts
    with progress_bar(f"eval {source}") as update:
        result = run_eval(source, config, StageHooks(status=note, window=update), store=store)
    if json:
        print_json(result.to_dict())
    else:
        render(source, result)


def render(source: str, r) -> None:
    cells = {"perplexity": f"{r.perplexity:.4f}", "mean NLL": f"{r.mean_nll:.5f}",
             "windows": f"{r.windows}/{r.windows_available}", "tokens scored": f"{r.tokens_scored:,}",
             "time": f"{r.seconds:.1f} s"}
    if r.kl_mean is not None:
        cells["mean KL(ref || model)"] = f"{r.kl_mean:.6f}"
    table = Table(title=f"perplexity of {source}", title_justify="left")
    for col in cells:
        table.add_column(col, justify="right")
    table.add_row(*cells.values())
    out.print(table)
    p = r.protocol
    out.print(f"[dim]protocol: {p['name']}; text {p['text_path']} ({r.tokens_total:,} tokens, rows joined by "
              f"'\\n\\n', no special tokens); seqlen {p['seqlen']}; ppl = exp(mean of per-window mean NLL)[/dim]")
