"""deploy/k8s read as objects, and what the server and the router answer to (routes, metrics, CLI options)."""
from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"


def load_all() -> list[dict]:
    """Every object of every manifest listed in kustomization.yaml, in order."""
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    return [doc for name in listed for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def find(objects: list[dict], kind: str, name: str | None = None) -> dict:
    hits = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(hits) == 1, f"{len(hits)} {kind} named {name}"
    return hits[0]


def container(workload: dict) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def serve_routes() -> set[tuple[str, str]]:
    from llmopt.stages.serve.http.routes import router

    return {(m, r.path) for r in router.routes for m in r.methods}


def router_routes() -> set[tuple[str, str]]:
    from llmopt.stages.route.app import create_router_app
    from llmopt.stages.route.config import RouteConfig

    app = create_router_app(RouteConfig(replicas=("http://replica:8000",)))
    return {(m, r.path) for r in app.routes for m in getattr(r, "methods", ())}


def serve_metric_names() -> set[str]:
    """Every family /metrics can export (engine stats present, as once loaded), with sample suffixes."""
    from llmopt.stages.serve.engine.engine import EngineStats
    from llmopt.stages.serve.http.metrics import Scrape, ServerMetrics

    stats = EngineStats(num_running=0, num_waiting=0, num_blocks=1, num_free_blocks=1, kv_cache_usage=0.0,
                        prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0)
    metrics = ServerMetrics("m", lambda: Scrape(stats, {}, True, {"block_size": "16"}))
    return {s.name for family in metrics.registry.collect() for s in family.samples}


def parse_command(argv: list[str]):
    """`llmopt ARGV` parsed by the real typer command, not run: (command name, its parameters). An unknown
    option or a bad value raises click's UsageError."""
    import typer

    from llmopt.cli.main import build_app

    group = typer.main.get_command(build_app(argv))
    command = group.commands[argv[0]]
    return argv[0], command.make_context(argv[0], list(argv[1:])).params
