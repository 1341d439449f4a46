"""The self-contained HTML report: the tables of `tables.py` and the figures of `plots.py` as
base64 PNGs in one file (no scripts, no external assets)."""
from __future__ import annotations

import base64
import html
import json
import os
from pathlib import Path

from ..errors import ArtifactError
from . import plots
from .tables import TableData, comparison_table, machine_table, source_tables

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
h3 { font-size: 1.05em; margin-bottom: .3em; }
table { border-collapse: collapse; margin: .4em 0 1em; font-size: .9em; }
th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
.note { color: #666; font-size: .85em; margin-top: -.6em; } img { max-width: 100%; }
code { background: #f3f3f3; padding: 0 .2em; }
"""


def _table(t: TableData, prefix: str = "table") -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in t.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in t.rows)
    note = f'<p class="note">{html.escape(t.note)}</p>' if t.note else ""
    return f'<h3 id="{prefix}-{t.key}">{html.escape(t.title)}</h3><table><tr>{head}</tr>{body}</table>{note}'


def _figure(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _section(key: str, title: str, *parts: str) -> str:
    return f'<section id="{key}"><h2>{html.escape(title)}</h2>{"".join(parts)}</section>'


def _summary(report: dict) -> str:
    lines = []
    for s in report["sources"]:
        r, b, c = s["roofline"], s["breakdown"]["decode"], s["capacity"]
        lines.append(f"<li><code>{html.escape(s['source'])}</code>: batch-1 decode {r['step_ms']:.1f} ms/step, "
                     f"{r['bandwidth_share']:.1%} of the copy bandwidth; per-layer parts sum to {b['ratio']:.1%} "
                     f"of the step; recommended <code>--max-num-seqs {c['recommended_max_num_seqs']}</code>"
                     + ("" if c.get("monotone", True) else " (the batch sweep is not monotone beyond its noise)")
                     + "</li>")
    return "<ul>" + "".join(lines) + "</ul>"


def render_html(report: dict) -> str:
    """The whole report as one HTML page."""
    sections = [
        _section("summary", "summary", _summary(report)),
        _section("comparison", "comparison", _table(comparison_table(report))),
        _section("machine", "machine", _table(machine_table(report))),
        _section("latency", "latency vs batch size and prompt length",
                 _figure(plots.latency_figure(report), "latency vs batch size")),
        _section("roofline", "roofline", _figure(plots.roofline_figure(report), "roofline")),
    ]
    for i, s in enumerate(report["sources"]):
        tables = "".join(_table(t, f"source-{i}") for t in source_tables(s, per_layer=True))
        sections.append(_section(f"source-{i}", f"{s['source']} ({s['model']['dtype']}, "
                                                f"{', '.join(s['model']['projections'])})",
                                 _figure(plots.breakdown_figure(s), "per-layer breakdown"), tables))
    config = html.escape(json.dumps(report["config"], indent=1))
    sections.append(_section("config", "configuration", f"<pre>{config}</pre>"))
    title = "llmopt profile: " + ", ".join(s["source"] for s in report["sources"])
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p>{html.escape(report['created_at'])}, llmopt {html.escape(str(report['version']))}</p>"
            + "".join(sections) + "</body></html>")


def write_text(path: Path, text: str) -> None:
    """Write atomically (temporary sibling, then rename); ArtifactError names the path on failure."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        raise ArtifactError(f"{path}: cannot write the report ({e.strerror or e})") from None


def write_report(report: dict, json_path: Path | None = None, html_path: Path | None = None) -> None:
    """The report as JSON and/or HTML files."""
    if json_path is not None:
        write_text(json_path, json.dumps(report, indent=2, default=str))
    if html_path is not None:
        write_text(html_path, render_html(report))


def check_output_path(path: Path | None, option: str) -> None:
    """Fail before measuring when a report could not be written there."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise ArtifactError(f"{option} {path}: is a directory; give a file name")
    parent = next((p for p in [path.parent, *path.parent.parents] if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ArtifactError(f"{option} {path}: cannot create the file there")
