"""llmopt eval SOURCE: perplexity (and KL vs --ref) with the GPTQ-style window protocol, on one text or several."""
from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from llmopt.stages.eval.config import OPTIONS

from .options import DType, DTypeOpt, Json, MaxWindows, Seqlen, Source, stage_options
from .ui import note, out, print_json, progress_bar

D = OPTIONS.defaults


def run(source: Source,
        text: Annotated[str, typer.Option("--text", help="wikitext2, wikitext2-valid, code, chat, a text file, or a "
                                          "comma list of them (all: wikitext2,code,chat).")] = D.text,
        seqlen: Seqlen = D.seqlen, max_windows: MaxWindows = D.max_windows,
        ref: Annotated[Optional[str], typer.Option("--ref", help="Reference source for mean KL divergence.")] = D.ref,
        dtype: DTypeOpt = DType(D.dtype),
        runtime: Annotated[str, typer.Option("--runtime", help="What computes the logits: transformers, or serve "
                                             "(llmopt's serve runtime and kernels).")] = D.runtime,
        store: Annotated[bool, typer.Option("--store/--no-store", help="Save the result in the artifact's manifest.")] = True,
        json: Json = False) -> None:
    from llmopt.stages.eval.config import EvalConfig
    from llmopt.stages.eval.run import run_evals
    from llmopt.stages.progress import StageHooks
    from llmopt.stages.source import resolve

    config = EvalConfig.from_options(stage_options(locals(), OPTIONS))  # a missing text fails before the load
    for name in filter(None, (source, config.ref)):
        resolve(name)  # so does a wrong path or alias, before the progress display starts
    with progress_bar(f"eval {source}") as update:
        results = run_evals(source, config, StageHooks(status=note, window=update), store=store)
    if json:
        print_json({name: result.to_dict() for name, result in results.items()})
    else:
        render(source, results)


def render(source: str, results: dict) -> None:
    """One row per text, then the protocol: the windows, and one line per text saying what it is."""
    from llmopt.stages.eval.measure import describe_text

    kl = any(r.kl_mean is not None for r in results.values())
    table = Table(title=f"perplexity of {source}", title_justify="left")
    columns = ["set", "perplexity", "mean NLL", "windows", "tokens scored", "time"]
    for col in columns + (["mean KL(ref || model)"] if kl else []):
        table.add_column(col, justify="left" if col == "set" else "right")
    for name, r in results.items():
        cells = [name, f"{r.perplexity:.4f}", f"{r.mean_nll:.5f}", f"{r.windows}/{r.windows_available}",
                 f"{r.tokens_scored:,}", f"{r.seconds:.1f} s"]
        table.add_row(*cells, *([f"{r.kl_mean:.6f}"] if kl else []))
    out.print(table)
    p = next(iter(results.values())).protocol
    out.print(f"protocol: {p['name']} of {p['seqlen']} tokens, the tail dropped; each text tokenised once, no "
              "special tokens added; ppl = exp(mean of per-window mean NLL)", style="dim", markup=False)
    for name, r in results.items():
        out.print(f"  {name}: {describe_text(r.protocol)} ({r.tokens_total:,} tokens)", style="dim", markup=False)
