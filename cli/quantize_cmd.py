"""llmopt quantize SOURCE -o OUT: RTN, GPTQ, AWQ, SmoothQuant W8A8 or bitsandbytes."""
from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from llmopt.stages.quantize.config import OPTIONS

from .options import (Calib, CalibSeqlen, Device, DType, DTypeOpt, EvalWindows, Force, Ignore, Json, NSamples, Output,
                      Seed, Source, stage_options)
from .ui import before_after_rows, human_bytes, out, run_stage

D = OPTIONS.defaults
Opt = typer.Option


def run(source: Source, output: Output,
        method: Annotated[str, Opt("--method", help="rtn | gptq | awq | smoothquant | bnb")] = D.method,
        scheme: Annotated[str, Opt("--scheme", help="W4A16 | W8A16 | W8A8 | NF4 | INT8")] = D.scheme,
        group_size: Annotated[str, Opt("--group-size", help="auto | 32 | 64 | 128 | -1 (per channel)")] = D.group_size,
        asym: Annotated[bool, Opt("--asym", help="Asymmetric grid (zero points).")] = D.asym,
        ignore: Ignore = D.ignore, calib: Calib = D.calib, nsamples: NSamples = D.nsamples,
        seqlen: CalibSeqlen = D.seqlen, seed: Seed = D.seed,
        act_order: Annotated[bool, Opt("--act-order", help="GPTQ: columns by descending Hessian diagonal.")] = D.act_order,
        damp: Annotated[float, Opt("--damp", help="GPTQ dampening, fraction of mean diag(H).")] = D.damp,
        sink_share: Annotated[float, Opt("--sink-share", help="GPTQ, AWQ: share of attention-sink tokens in the "
                                         "Hessian / search loss (0: plain).")] = D.sink_share,
        observer: Annotated[str, Opt("--observer", help="GPTQ: group range by mse (shrunk to least error) "
                                     "or minmax.")] = D.observer,
        alpha: Annotated[float, Opt("--alpha", help="SmoothQuant migration strength.")] = D.alpha,
        device: Device = D.device, dtype: DTypeOpt = DType(D.dtype), eval_windows: EvalWindows = D.eval_windows,
        embeddings: Annotated[str, Opt("--embeddings", help="auto | keep | int8: the input embedding (and a "
                                       "tied lm_head) as RTN int8 groups; auto: int8 where it is over a third of "
                                       "the parameters. llmopt reads it; transformers only with "
                                       "CompressedTensorsConfig(dequantize=True) and W8A16 Linears; vLLM not.")]
        = D.embeddings,
        force: Force = False, json: Json = False) -> None:
    from llmopt.stages.quantize.config import QuantizeConfig
    from llmopt.stages.quantize.run import run_quantize

    config = QuantizeConfig.from_options(stage_options(locals(), OPTIONS))
    run_stage("quantize", lambda hooks: run_quantize(source, output, config, force=force, hooks=hooks), json, render)


def render(art, metrics: dict) -> None:
    from llmopt.stages.quantize.config import group_size_text

    table = Table(title=f"quantized -> {art.path}", title_justify="left", show_header=False)
    cfg = art.manifest["config"]
    table.add_row("method / scheme", f"{cfg['method']} {cfg['scheme']} group {group_size_text(cfg['group_size'])}"
                  f" {'sym' if cfg['symmetric'] else 'asym'}")
    if cfg.get("embeddings", "keep") != "keep":
        table.add_row("embeddings", cfg["embeddings"])
    table.add_row("weights on disk", human_bytes(metrics["size_bytes"]))
    if "quantize_seconds" in metrics:
        table.add_row("time", f"{metrics['quantize_seconds']:.1f} s")
    for row in before_after_rows(metrics.get("perplexity_before_after")):
        table.add_row(*row)
    out.print(table)
