"""llmopt shard SOURCE --tp N -o OUT: split a model (dense or quantized) for tensor-parallel serving."""
from __future__ import annotations

from typing import Annotated

import typer

from .options import Force, Json, Output, Source, stage_options
from .shard_view import render
from .ui import run_stage


def run(source: Source, output: Output,
        tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel ranks (any count up to the query heads).")],
        force: Force = False, json: Json = False) -> None:
    from llmopt.stages.shard.config import OPTIONS, ShardConfig
    from llmopt.stages.shard.run import run_shard

    config = ShardConfig.from_options(stage_options(locals(), OPTIONS))
    run_stage("shard", lambda hooks: run_shard(source, output, config, force=force, hooks=hooks), json, render)

