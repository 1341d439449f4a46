"""The table `llmopt shard` prints: each rank's heads, channels, vocabulary rows and size."""
from __future__ import annotations

from rich.table import Table

from .ui import human_bytes, out


def render(art, metrics: dict) -> None:
    plan = art.tensor_parallel
    table = Table(title=f"sharded for --tp {plan['tp']} -> {art.path}", title_justify="left")
    for col in ("rank", "query heads", "KV heads", "MLP channels", "vocab rows", "weights", "share"):
        table.add_column(col, justify="right" if col in ("weights", "share") else "left", overflow="fold")
    source = metrics.get("source_bytes")
    for r, nbytes in zip(plan["ranks"], metrics["rank_bytes"]):
        q, m, v = r["q_heads"], r["mlp"], r["vocab"]
        table.add_row(str(r["rank"]), f"{q[0]}-{q[-1]} ({len(q)})", kv_heads_cell(r["kv_heads"]),
                      f"{m[0]}:{m[1]}", f"{v[0]}:{v[1]}", human_bytes(nbytes),
                      f"{nbytes / source:.1%}" if source else "")
    out.print(table)
    if source and sum(metrics["rank_bytes"]) > source:
        out.print(f"[dim]{share_note(plan, sum(metrics['rank_bytes']) / source)}[/dim]")
    out.print(f"[dim]serve it with: llmopt serve {art.path}  (starts {plan['tp']} rank processes)[/dim]")


def kv_heads_cell(kv_heads: list[int]) -> str:
    """The set of KV heads a rank reads ("0,1"). The plan lists one per query head (0,0,0,1,1) where the
    rank stores a copy per query head (plan.head_assignment); share_note says so."""
    return ",".join(map(str, sorted(set(kv_heads))))


def share_note(plan: dict, total: float) -> str:
    """Why the shares add up to more than 100% (`total`): what every rank, or several, hold a copy of."""
    seen: dict[int, int] = {}
    for r in plan["ranks"]:
        for h in set(r["kv_heads"]):
            seen[h] = seen.get(h, 0) + 1
    shared = sorted(h for h, n in seen.items() if n > 1)
    copies = [str(r["rank"]) for r in plan["ranks"] if len(r["kv_heads"]) > len(set(r["kv_heads"]))]
    why = ["the norms are replicated on every rank"]
    if shared:
        heads = f"KV head {shared[0]} is" if len(shared) == 1 else f"KV heads {','.join(map(str, shared))} are"
        why.append(f"{heads} replicated on the ranks that read them")
    if copies:
        ranks = f"rank {copies[0]} holds" if len(copies) == 1 else f"ranks {','.join(copies)} hold"
        why.append(f"{ranks} a copy of a KV head per query head (their query heads fall unevenly on KV heads)")
    return f"shares add up to {total:.1%}: " + "; ".join(why)
