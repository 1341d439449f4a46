"""llmopt quantize SOURCE -o OUT: RTN, GPTQ, AWQ, SmoothQuant W8A8 or bitsandbytes."""
from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from .options import DType, DTypeOpt, Force, Json, Output, Source
from .ui import human_bytes, out, run_stage

Method = Annotated[str, typer.Option("--method", help="rtn | gptq | awq | smoothquant | bnb")]
Scheme = Annotated[str, typer.Option("--scheme", help="W4A16 | W8A16 | W8A8 | NF4 | INT8")]


def run(source: Source, output: Output, method: Method = "gptq", scheme: Scheme = "W4A16",
        group_size: Annotated[str, typer.Option("--group-size", help="auto | 32 | 64 | 128 | -1 (per channel)")] = "auto",
        asym: Annotated[bool, typer.Option("--asym", help="Asymmetric grid (zero points).")] = False,
        ignore: Annotated[Optional[list[str]], typer.Option("--ignore", help="Linear names/globs/re: to keep dense.")] = None,
        calib: Annotated[str, typer.Option("--calib", help="wikitext2-valid | sharegpt | FILE | self")] = "wikitext2-valid",
        nsamples: Annotated[int, typer.Option("--nsamples", min=1)] = 128,
        seqlen: Annotated[int, typer.Option("--seqlen", min=2)] = 2048,
        seed: Annotated[int, typer.Option("--seed")] = 0,
        act_order: Annotated[bool, typer.Option("--act-order", help="GPTQ: columns by descending Hessian diagonal.")] = False,
        damp: Annotated[float, typer.Option("--damp", help="GPTQ dampening, fraction of mean diag(H).")] = 0.01,
        sink_share: Annotated[float, typer.Option("--sink-share", help="GPTQ, AWQ: share of attention-sink tokens in the Hessian / search loss (0: plain).")] = 0.03,
        observer: Annotated[str, typer.Option("--observer", help="GPTQ: group range by mse (shrunk to least error) or minmax.")] = "mse",
        alpha: Annotated[float, typer.Option("--alpha", help="SmoothQuant migration strength.")] = 0.5,
        device: Annotated[str, typer.Option("--device", help="cpu | cuda")] = "cpu",
        dtype: DTypeOpt = DType.auto,
        eval_windows: Annotated[int, typer.Option("--eval-windows", min=0, help="Perplexity windows before/after (0: off).")] = 4,
        embeddings: Annotated[str, typer.Option("--embeddings", help="keep | int8: the input embedding (and a tied "
                              "lm_head) as RTN int8 groups. llmopt reads it; transformers only with "
                              "CompressedTensorsConfig(dequantize=True) and W8A16 Linears; vLLM not.")] = "keep",
        force: Force = False, json: Json = False) -> None:
    from llmopt.stages.model_io import parse_dtype
    from llmopt.stages.quantize.run import run_quantize

    config = build_config(locals())
    run_stage("quantize", lambda hooks: run_quantize(source, output, config, dtype=parse_dtype(dtype.value), force=force,
                                           hooks=hooks), json, render)


def build_config(o: dict):
    """The validated QuantizeConfig for `run`'s options (also what a recipe's quantize stage takes)."""
    from llmopt.stages.calib import CalibConfig
    from llmopt.stages.quantize.config import QuantizeConfig

    config = QuantizeConfig(method=o["method"], scheme=o["scheme"].upper(), group_size=str(o["group_size"]),
                            symmetric=not o["asym"], ignore=tuple(o["ignore"] or ()),
                            calib=CalibConfig(o["calib"], o["nsamples"], o["seqlen"], o["seed"]), damp=o["damp"],
                            act_order=o["act_order"], sink_share=o["sink_share"], observer=o["observer"], smoothing_alpha=o["alpha"],
                            device=o["device"], eval_windows=o["eval_windows"],
                            embeddings=o["embeddings"])
    config.validate()
    return config


def render(art, metrics: dict) -> None:
    table = Table(title=f"quantized -> {art.path}", title_justify="left", show_header=False)
    cfg = art.manifest["config"]
    table.add_row("method / scheme", f"{cfg['method']} {cfg['scheme']} group {cfg['group_size']}"
                  f" {'sym' if cfg['symmetric'] else 'asym'}")
    if cfg.get("embeddings", "keep") != "keep":
        table.add_row("embeddings", cfg["embeddings"])
    table.add_row("weights on disk", human_bytes(metrics["size_bytes"]))
    if "quantize_seconds" in metrics:
        table.add_row("time", f"{metrics['quantize_seconds']:.1f} s")
    ba = metrics.get("perplexity_before_after")
    if ba:
        table.add_row("perplexity", f"{ba['before']:.4f} -> {ba['after']:.4f} ({ba['increase_pct']:+.2f}%), {ba['protocol']}")
    out.print(table)
