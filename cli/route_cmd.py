"""llmopt route --replica URL ...: one OpenAI-compatible endpoint in front of llmopt serve replicas."""
from __future__ import annotations

from typing import Annotated

import typer

from llmopt.stages.route.config import POLICIES, RouteConfig

Opt = typer.Option
D = RouteConfig()


def run(replica: Annotated[list[str], Opt("--replica", help="A replica's base URL, http://host:port "
                                          "(repeatable).")],
        policy: Annotated[str, Opt("--policy", help=" | ".join(POLICIES))] = D.policy,
        host: Annotated[str, Opt("--host", help="Address to bind (loopback unless you open it).")] = D.host,
        port: Annotated[int, Opt("--port", min=0, max=65535)] = D.port,
        health_interval: Annotated[float, Opt("--health-interval", help="Seconds between health checks of each "
                                              "replica.")] = D.health_interval_s,
        eject_after: Annotated[int, Opt("--eject-after", help="Failed checks in a row that take a replica out (a "
                                        "refused connection: one).")] = D.eject_after,
        retries: Annotated[int, Opt("--retries", help="Other replicas tried for a request that failed before its "
                                    "first byte.")] = D.retries,
        balance_abs: Annotated[int, Opt("--balance-abs", help="cache-aware: route by load once the busiest replica "
                                        "has this many more requests than the idlest ...")] = D.balance_abs,
        balance_rel: Annotated[float, Opt("--balance-rel", help="... and this many times the idlest's + 1.")]
        = D.balance_rel,
        cache_threshold: Annotated[float, Opt("--cache-threshold", help="cache-aware: the share of a prompt a "
                                              "replica's prefix tree must match to take it.")] = D.match_ratio) -> None:
    import uvicorn

    from llmopt.stages.route.app import create_router_app

    config = RouteConfig(tuple(replica), policy, host, port, health_interval, eject_after, balance_abs, balance_rel,
                         cache_threshold, retries=retries)
    app = create_router_app(config)  # ConfigError (one line, exit 2) before anything binds
    typer.echo(f"routing {len(config.replicas)} replicas ({config.policy}) on http://{host}:{port}", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)
