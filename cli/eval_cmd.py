"""llmopt eval SOURCE: perplexity (and KL vs --ref) with the GPTQ-style window protocol."""
from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from .options import DType, DTypeOpt, Json, MaxWindows, Seqlen, Source
from .ui import err, out, print_json, progress_bar


def run(source: Source,
        text: Annotated[str, typer.Option("--text", help="wikitext2, wikitext2-valid, or a text file.")] = "wikitext2",
        seqlen: Seqlen = 2048, max_windows: MaxWindows = None,
        ref: Annotated[Optional[str], typer.Option("--ref", help="Reference source for mean KL divergence.")] = None,
        dtype: DTypeOpt = DType.auto,
        store: Annotated[bool, typer.Option("--store/--no-store", help="Save the result in the artifact's manifest.")] = True,
        json: Json = False) -> None:
    from llmopt.stages import source as sources
    from llmopt.stages.evaluate import evaluate, metric_key
    from llmopt.stages.model_io import parse_dtype

    config = build_config(locals())
    torch_dtype = parse_dtype(dtype.value)
    with err.status(f"loading {source}"):
        loaded = sources.load(source, dtype=torch_dtype)
        ref_model = sources.load(ref, dtype=torch_dtype).model if ref else None
    with progress_bar(f"eval {source}") as update:
        result = evaluate(loaded.model, loaded.tokenizer, config, ref_model=ref_model, on_window=update)
    if store and loaded.artifact is not None:
        loaded.artifact.update_metrics(metric_key(config), stored(result))
    if json:
        print_json(result.to_dict())
    else:
        render(source, result)


def build_config(o: dict):
    """The validated EvalConfig for `run`'s options (also what a recipe's eval stage takes)."""
    from llmopt.stages.data import resolve_text
    from llmopt.stages.evaluate import EvalConfig

    config = EvalConfig(text=o["text"], seqlen=o["seqlen"], max_windows=o["max_windows"], ref=o["ref"])
    config.validate()
    resolve_text(o["text"])  # fail on a missing data set before the slow model load
    return config


def stored(result) -> dict:
    """What the manifest keeps of an eval result (no per-window numbers)."""
    data = result.to_dict()
    data.pop("window_nll")
    return data


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
