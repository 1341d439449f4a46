"""The table `llmopt shard` prints: each rank's stage and layers, heads, channels, vocabulary rows and size."""
from __future__ import annotations

from rich.table import Table

from llmopt.stages.shard.pipeline import stage_of_rank, tp_index

from .ui import human_bytes, out


def render(art, metrics: dict) -> None:
    plan, pipeline = art.tensor_parallel, art.pipeline_parallel
    layout = f"--tp {plan['tp']}" + (f" --pp {pipeline['pp']}" if pipeline else "")
    table = Table(title=f"sharded for {layout} -> {art.path}", title_justify="left")
    columns = ("rank", *(("stage", "layers") if pipeline else ()), "query heads", "KV heads", "MLP channels",
               "vocab rows", "weights", "share")
    for col in columns:
        table.add_column(col, justify="right" if col in ("weights", "share") else "left", overflow="fold")
    source = metrics.get("source_bytes")
    for (g, r, stage), nbytes in zip(rank_rows(plan, pipeline), metrics["rank_bytes"]):
        q, m, v = r["q_heads"], r["mlp"], r["vocab"]
        vocab = f"{v[0]}:{v[1]}" if stage is None or stage["embed"] or stage["head"] else ""
        table.add_row(str(g), *stage_cells(stage), f"{q[0]}-{q[-1]} ({len(q)})", kv_heads_cell(r["kv_heads"]),
                      f"{m[0]}:{m[1]}", vocab, human_bytes(nbytes), f"{nbytes / source:.1%}" if source else "")
    out.print(table)
    if source and sum(metrics["rank_bytes"]) > source and (pipeline is None or plan["tp"] > 1):
        out.print(f"[dim]{share_note(plan, sum(metrics['rank_bytes']) / source, pipeline)}[/dim]")
    if pipeline and pipeline["tied_lm_head_duplicated"]:
        out.print(f"[dim]lm_head is tied to the embedding: the last stage ({pipeline['pp'] - 1}) holds its own copy "
                  "of the embedding to compute the logits[/dim]")
    out.print(f"[dim]serve it with: llmopt serve {art.path}  (starts {art.world_size} rank processes)[/dim]")


def rank_rows(plan: dict, pipeline: dict | None) -> list[tuple[int, dict, dict | None]]:
    """(global rank, its entry of the TP plan, its pipeline stage or None) for every rank."""
    if pipeline is None:
        return [(r["rank"], r, None) for r in plan["ranks"]]
    return [(g, plan["ranks"][tp_index(pipeline, g)], stage_of_rank(pipeline, g))
            for g in range(pipeline["world_size"])]


def stage_cells(stage: dict | None) -> tuple[str, ...]:
    """The stage and layers cells ("embed + 0-14 (15)", "15-29 (15) + head"); none without pipeline stages."""
    if stage is None:
        return ()
    a, b = stage["layers"]
    layers = ("embed + " if stage["embed"] else "") + f"{a}-{b - 1} ({b - a})" + (" + head" if stage["head"] else "")
    return str(stage["stage"]), layers


def kv_heads_cell(kv_heads: list[int]) -> str:
    """The set of KV heads a rank reads ("0,1"). The plan lists one per query head (0,0,0,1,1) where the
    rank stores a copy per query head (plan.head_assignment); share_note says so."""
    return ",".join(map(str, sorted(set(kv_heads))))


def share_note(plan: dict, total: float, pipeline: dict | None = None) -> str:
    """Why the shares add up to more than 100% (`total`): what every rank, or several, hold a copy of (within
    each stage, under `pipeline`)."""
    seen: dict[int, int] = {}
    for r in plan["ranks"]:
        for h in set(r["kv_heads"]):
            seen[h] = seen.get(h, 0) + 1
    shared = sorted(h for h, n in seen.items() if n > 1)
    copies = [str(g) for g, r, _ in rank_rows(plan, pipeline) if len(r["kv_heads"]) > len(set(r["kv_heads"]))]
    why = ["the norms are replicated on every rank" + (" of a stage" if pipeline else "")]
    if shared:
        heads = f"KV head {shared[0]} is" if len(shared) == 1 else f"KV heads {','.join(map(str, shared))} are"
        why.append(f"{heads} replicated on the ranks that read them")
    if copies:
        ranks = f"rank {copies[0]} holds" if len(copies) == 1 else f"ranks {','.join(copies)} hold"
        why.append(f"{ranks} a copy of a KV head per query head (their query heads fall unevenly on KV heads)")
    return f"shares add up to {total:.1%}: " + "; ".join(why)
