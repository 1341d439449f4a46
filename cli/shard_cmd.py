"""llmopt shard SOURCE --tp N -o OUT: split a model (dense or quantized) for tensor-parallel serving."""
from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from .options import Force, Json, Output, Source, stage_options
from .ui import human_bytes, out, run_stage


def run(source: Source, output: Output,
        tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel ranks (any count up to the query heads).")],
        force: Force = False, json: Json = False) -> None:
    from llmopt.stages.shard.config import OPTIONS, ShardConfig
    from llmopt.stages.shard.run import run_shard

    config = ShardConfig.from_options(stage_options(locals(), OPTIONS))
    run_stage("shard", lambda hooks: run_shard(source, output, config, force=force, hooks=hooks), json, render)


def render(art, metrics: dict) -> None:
    plan = art.tensor_parallel
    table = Table(title=f"sharded for --tp {plan['tp']} -> {art.path}", title_justify="left")
    for col in ("rank", "query heads", "KV heads", "MLP channels", "vocab rows", "weights", "share"):
        table.add_column(col, justify="right" if col in ("weights", "share") else "left")
    for r, nbytes in zip(plan["ranks"], metrics["rank_bytes"]):
        q, kv, m, v = r["q_heads"], r["kv_heads"], r["mlp"], r["vocab"]
        table.add_row(str(r["rank"]), f"{q[0]}-{q[-1]} ({len(q)})", ",".join(map(str, kv)),
                      f"{m[0]}:{m[1]}", f"{v[0]}:{v[1]}", human_bytes(nbytes),
                      f"{nbytes / metrics['source_bytes']:.1%}" if metrics.get("source_bytes") else "")
    out.print(table)
    out.print(f"[dim]serve it with: llmopt serve {art.path}  (starts {plan['tp']} rank processes)[/dim]")
