"""`llmopt serve --data-parallel N`: N engine replicas behind this process's endpoint.

Each replica is an `llmopt serve` process of its own (its own engine and KV cache) on a loopback port, started
with this command's options (through a `--config` file) but for the address and the replica count. On CPU
each gets its own cores (`--cores-per-replica`, default the usable CPUs shared out evenly) by
`os.sched_setaffinity` before it starts, and as many torch threads; on CUDA its own devices
(`CUDA_VISIBLE_DEVICES`, `--tensor-parallel-size` of them each). This process then serves the router of
`llmopt route` (stages/route) on the command's host and port, in-process, with `--router-policy`; its /metrics
adds every replica's series with a `replica` label, and /health lists each replica. SIGTERM drains the
replicas (each its own drain) after the router stops taking requests; a replica that exits takes nothing
else down: the router ejects it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from ..errors import ConfigError
from .config import ServeConfig

log = logging.getLogger("llmopt.serve")
READY_TIMEOUT_S = 600.0
DP_ONLY = ("data_parallel", "cores_per_replica", "router_policy", "host", "port", "threads")


def core_sets(cpus: list[int], replicas: int, per_replica: int | None) -> list[list[int]]:
    """Each replica's cores: `per_replica` of `cpus` each (default: shared out evenly); ConfigError when they
    do not fit."""
    per = per_replica or len(cpus) // replicas
    if per < 1 or per * replicas > len(cpus):
        raise ConfigError(f"--data-parallel {replicas} x {per_replica or per} cores needs {replicas * max(per, 1)} "
                          f"CPUs; this process may use {len(cpus)} ({','.join(map(str, cpus))})")
    return [cpus[i * per:(i + 1) * per] for i in range(replicas)]


def replica_options(options: dict, port: int, threads: int | None) -> dict:
    """A replica's options: this command's, on a loopback port, one replica, `threads` threads."""
    out = {k: v for k, v in options.items() if k not in DP_ONLY and v is not None}
    return out | {"host": "127.0.0.1", "port": port} | ({"threads": threads} if threads else {})


def serve_data_parallel(source: str, options: dict, config: ServeConfig) -> int:
    """Start the replicas, serve the router until SIGTERM/SIGINT, then stop them; the exit code."""
    import yaml

    n, cuda = config.data_parallel, config.device.startswith("cuda")
    cores = None if cuda else core_sets(sorted(os.sched_getaffinity(0)), n, config.cores_per_replica)
    ports = [_free_port() for _ in range(n)]
    with tempfile.TemporaryDirectory(prefix="llmopt-dp-") as tmp:
        procs = []
        for i, port in enumerate(ports):
            path = Path(tmp) / f"replica-{i}.yaml"
            path.write_text(yaml.safe_dump(replica_options(options, port, len(cores[i]) if cores else None)))
            procs.append(_start(source, path, cores[i] if cores else None, _devices(config, i) if cuda else None))
        try:
            _wait_ready(procs, ports)
            return _route(config, ports)
        finally:
            _stop(procs)


def _devices(config: ServeConfig, i: int) -> str:
    per = config.tensor_parallel_size
    return ",".join(str(d) for d in range(i * per, (i + 1) * per))


def _start(source: str, config_file: Path, cpus: list[int] | None, devices: str | None) -> subprocess.Popen:
    env = dict(os.environ) | ({"CUDA_VISIBLE_DEVICES": devices} if devices is not None else {})

    def prepare() -> None:  # in the child, before it runs: its cores, and SIGTERM when this process dies
        if cpus:
            os.sched_setaffinity(0, cpus)
        _die_with_parent()

    return subprocess.Popen([sys.executable, "-m", "llmopt.cli.main", "serve", source, "--config", str(config_file)],
                            env=env, preexec_fn=prepare)


def _die_with_parent() -> None:
    """Linux: the kernel sends this process SIGTERM when its parent dies (a killed router leaves no replica)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # not Linux: the replica outlives a killed parent
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _wait_ready(procs: list[subprocess.Popen], ports: list[int]) -> None:
    deadline, waiting = time.monotonic() + READY_TIMEOUT_S, set(range(len(ports)))
    while waiting:
        for i in sorted(waiting):
            if procs[i].poll() is not None:
                raise ConfigError(f"replica {i} exited with {procs[i].returncode} before it was ready (its error "
                                  "is above)")
            with contextlib.suppress(OSError):  # not listening yet, or 503 while it loads
                with urllib.request.urlopen(f"http://127.0.0.1:{ports[i]}/health", timeout=2) as r:
                    if r.status == 200:
                        waiting.discard(i)
        if time.monotonic() > deadline:
            raise ConfigError(f"replicas {sorted(waiting)} were not ready within {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.2)


def _route(config: ServeConfig, ports: list[int]) -> int:
    import uvicorn

    from ..route.app import create_router_app
    from ..route.config import RouteConfig

    replicas = tuple(f"http://127.0.0.1:{p}" for p in ports)
    app = create_router_app(RouteConfig(replicas, config.router_policy, config.server.host, config.server.port),
                            replica_metrics=True)
    log.info("serving %d replicas (%s) on http://%s:%d", len(replicas), config.router_policy, config.server.host,
             config.server.port)
    uvicorn.run(app, host=config.server.host, port=config.server.port, log_level="warning",
                timeout_graceful_shutdown=int(config.server.drain_timeout_s))
    return 0


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to every replica (each drains), then wait; a replica still running after its drain is killed."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
