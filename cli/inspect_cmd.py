"""llmopt inspect ARTIFACT: manifest, lineage, parameters, bytes by dtype, metrics."""
from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from .options import Json, Source
from .ui import before_after_rows, err, human_bytes, out, print_json


def run(artifact: Source, json: Json = False,
        verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Hash every file (other commands skip "
                                             "files hashed before and unchanged since).")] = True) -> None:
    from llmopt.stages import source as sources
    from llmopt.stages.inspect import summarize

    src = sources.resolve(artifact)
    if src.kind == "artifact":
        from llmopt.stages.artifact import Artifact

        art = Artifact.open(src.path, verify=verify, full=verify)
    else:
        with err.status(f"resolving {artifact}"):
            art = sources.as_artifact(src)
    if art is None:
        summary = summarize(src.path, None)
    else:
        summary = summarize(art.path, art.manifest)
    if json:
        print_json(summary)
    else:
        render_summary(summary)


def render_summary(s: dict) -> None:
    m = s.get("manifest") or {}
    head = Table(show_header=False, box=None, title=f"[bold]{s['path']}[/bold]", title_justify="left")
    for key, value in (("stage", m.get("stage", "(plain HF directory)")), ("format", m.get("format_version")),
                       ("tool", m.get("tool_version")), ("created", m.get("created_at")),
                       ("content hash", (m.get("content_hash") or "")[:32] or None), ("architecture", s["architecture"]),
                       ("parameters", f"{s['num_parameters']:,}"), ("weights on disk", human_bytes(s["weight_bytes"]))):
        if value is not None:
            head.add_row(f"[cyan]{key}[/cyan]", str(value))
    out.print(head)
    _table("bytes by dtype", ["dtype", "tensors", "parameters", "bytes"],
           [[d, str(v["tensors"]), f"{v['parameters']:,}", human_bytes(v["bytes"])] for d, v in s["by_dtype"].items()])
    _table("lineage (oldest first)", ["#", "stage", "content hash", "created", "config"],
           [[str(i), e["stage"], e["content_hash"][:16], str(e.get("created_at", ""))[:16].replace("T", " "), _short(e.get("config"))]
            for i, e in enumerate(m.get("lineage", []))])
    if m.get("source"):
        src = m["source"]
        out.print(f"[cyan]source[/cyan] {src.get('kind')} {src.get('ref')} sha256={str(src.get('sha256', '-'))[:16]}")
    metrics = m.get("metrics") or {}
    rows = []
    for k, v in metrics.items():
        if k == "perplexity_before_after":  # a row per evaluation set
            rows += [[k + label.removeprefix("perplexity").replace(" ", ": ", 1), text]
                     for label, text in before_after_rows(v)]
        elif k != "sparsity":
            rows.append([k, _short(v)])
    _table("metrics", ["metric", "value"], rows)
    _sparsity_table(metrics.get("sparsity"))


def _sparsity_table(s: dict | None) -> None:
    """Per decoder layer, the share of zeros in each pruned Linear (from `llmopt prune`)."""
    by_layer: dict[int, dict[str, float]] = {}
    for name, value in ((s or {}).get("linears") or {}).items():
        parts = name.split(".")  # model.layers.{i}.{module}.{linear}
        if len(parts) > 3 and parts[2].isdigit():
            by_layer.setdefault(int(parts[2]), {})[".".join(parts[3:])] = value
    columns = list(dict.fromkeys(c for row in by_layer.values() for c in row))
    rows = [[str(i)] + [f"{row[c]:.1%}" if c in row else "-" for c in columns] for i, row in sorted(by_layer.items())]
    title = f"sparsity: {s['method']} {s['pattern']}, {s['overall']:.2%} of the pruned weights" if rows else ""
    _table(title, ["layer"] + [c.split(".")[-1] for c in columns], rows)


def _short(value, limit: int = 90) -> str:
    if isinstance(value, dict) and "perplexity" in value:
        text = f"ppl {value['perplexity']:.4f} ({value.get('windows')} windows, {value.get('tokens_scored'):,} tokens)"
        return text + (f", KL {value['kl_mean']:.5f}" if value.get("kl_mean") is not None else "")
    if isinstance(value, dict):
        text = " ".join(f"{k}={v}" for k, v in value.items())
    else:
        text = f"{value:,}" if isinstance(value, int) else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    if not rows:
        return
    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*r)
    out.print(table)
