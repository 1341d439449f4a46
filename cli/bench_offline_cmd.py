"""llmopt bench --offline SOURCE ...: the serve engine in this process against transformers, no HTTP
(bench_cmd.py parses; this runs the offline stage and renders its report)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from llmopt.stages.bench.stage import OPTIONS
from llmopt.stages.offline.config import OPTIONS as OFFLINE_OPTIONS
from llmopt.stages.offline.config import SHARED
from llmopt.stages.options import flag

from . import bench_view
from .ui import note

ONLINE_ONLY = ("url", "server", "grpc", "model", "api_key", "plot", *(n for n in OPTIONS if n not in SHARED))
OFFLINE_ONLY = tuple(n for n in OFFLINE_OPTIONS if n not in SHARED)


def check_mode(ctx: typer.Context, offline: bool) -> None:
    """An option of the other kind of run (--request-rate with --offline, --hf-batch-size with --url)
    is a mistake: say which."""
    from llmopt.stages.errors import ConfigError

    names = ONLINE_ONLY if offline else OFFLINE_ONLY
    # typer's click names the source of each value; only what was typed counts (not $LLMOPT_API_KEY)
    given = [n for n in names if getattr(ctx.get_parameter_source(n), "name", None) == "COMMANDLINE"]
    if offline and {"url", "server", "grpc"} & set(given):
        raise ConfigError("give --offline SOURCE (the engine in this process) or --url / --server, not both")
    if given and offline:
        raise ConfigError(f"{flag(given[0])} is for runs against a server (--url, --server); --offline runs the "
                          "engine in this process")
    if given:
        raise ConfigError(f"{flag(given[0])} is for --offline runs only")


def run_offline(sources: list[str], options: dict, json_path: Optional[Path], quiet: bool) -> int:
    from llmopt.stages.bench.report import write_report
    from llmopt.stages.offline.config import OfflineConfig
    from llmopt.stages.offline.run import run_offline as run
    from llmopt.stages.progress import StageHooks

    report = run(sources, OfflineConfig.from_options(options), StageHooks(status=(lambda m: None) if quiet else note))
    bench_view.render_offline(report)
    if json_path:
        write_report(report, json_path)
        note(f"wrote {json_path}")
    return 0
