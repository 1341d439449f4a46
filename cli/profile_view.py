"""How `llmopt profile` looks: its reports' titled tables (stages/profile builds them) as rich tables."""
from __future__ import annotations

from rich.table import Table

from .ui import out


def render(report: dict, per_layer: bool) -> None:
    """The sweep's tables: the machine, each source's, and the sources side by side."""
    from llmopt.stages.profile.tables import comparison_table, machine_table, source_tables

    tables = [machine_table(report)]
    for s in report["sources"]:
        tables += source_tables(s, per_layer)
    print_tables(tables + [comparison_table(report)])


def print_tables(tables) -> None:
    for t in tables:
        table = Table(*t.columns, title=t.title, title_justify="left", caption=t.note or None,
                      caption_justify="left")
        for row in t.rows:
            table.add_row(*row)
        out.print(table)
