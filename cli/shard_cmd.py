"""llmopt shard SOURCE [--tp N] [--pp M] -o OUT: split a model (dense or quantized) for tensor- and pipeline-parallel
serving."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from llmopt.stages.shard.config import OPTIONS

from .options import Force, Json, Output, Source, stage_options
from .shard_view import render
from .ui import run_stage

D = OPTIONS.defaults
Tp = Annotated[int, typer.Option("--tp", help="Tensor-parallel ranks per stage (any count up to the query heads).")]
Pp = Annotated[int, typer.Option("--pp", help="Pipeline stages: contiguous runs of decoder layers, balanced by bytes.")]
PpBalance = Annotated[str, typer.Option("--pp-balance", help="What the stages balance: decode (bytes a decode step "
                                        "reads; the embedding is a gather) or memory (bytes each stage stores).")]
PpLayers = Annotated[Optional[str], typer.Option(
    "--pp-layers", help="Each stage's layers instead of balancing, inclusive ranges: 0-9,10-19,20-29.")]


def run(source: Source, output: Output, tp: Tp = D.tp, pp: Pp = D.pp, pp_layers: PpLayers = D.pp_layers,
        pp_balance: PpBalance = D.pp_balance, force: Force = False, json: Json = False) -> None:
    from llmopt.stages.shard.config import ShardConfig
    from llmopt.stages.shard.run import run_shard

    config = ShardConfig.from_options(stage_options(locals(), OPTIONS))
    run_stage("shard", lambda hooks: run_shard(source, output, config, force=force, hooks=hooks), json, render)
