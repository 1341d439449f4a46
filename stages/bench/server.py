"""--server SOURCE: start a server as a subprocess on a free loopback port, wait for /health, stop it.

The engine is `llmopt serve` (default) or, for baselines, the plain-transformers server
(`--engine hf`: `python -m llmopt.stages.serve.baseline`, started by its module name, so the bench
still imports nothing of the engine). Its output goes to a log file whose last lines explain a server
that dies or never becomes healthy.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..errors import ConfigError, LlmoptError

BASELINE_MODULE = "llmopt.stages.serve.baseline"
ENGINES = ("llmopt", "hf")
TAIL_LINES = 15


class ServerError(LlmoptError):
    """The server started for the bench exited or never answered /health."""


@dataclass(frozen=True)
class ServerSpec:
    source: str
    engine: str = "llmopt"
    args: tuple[str, ...] = ()  # extra options for the server, e.g. ("--max-num-seqs", "32")
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 15.0
    host: str = "127.0.0.1"

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine {self.engine}: use llmopt or hf")
        if self.startup_timeout_s <= 0:
            raise ConfigError("--server-timeout must be positive")

    def command(self, port: int) -> list[str]:
        if self.engine == "hf":
            head = [sys.executable, "-m", BASELINE_MODULE, self.source]
        else:
            # Nothing balances load onto a server bench started itself: no grace window when it stops
            # (given first, so --serve-args can still set one).
            head = [sys.executable, "-m", "llmopt.cli.main", "serve", self.source, "--drain-grace", "0"]
        return [*head, "--port", str(port), *self.args]

    def describe(self) -> dict:
        return {"source": self.source, "engine": self.engine, "args": list(self.args)}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextmanager
def running_server(spec: ServerSpec, status: Callable[[str], None] = lambda message: None) -> Iterator[str]:
    """Yields the base URL of a healthy server; stops it (SIGTERM, then SIGKILL) however the block ends."""
    spec.validate()
    port = free_port(spec.host)
    with tempfile.TemporaryDirectory(prefix="llmopt-bench-") as tmp:
        log_path = Path(tmp) / "server.log"
        with open(log_path, "wb") as log:
            command = spec.command(port)
            status(f"starting {' '.join(command[1:])}")
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            # Its own session: a Ctrl-C in the terminal reaches us, and we stop the server in order.
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
            try:
                url = f"http://{spec.host}:{port}"
                wait_healthy(proc, url, spec.startup_timeout_s, log_path, spec.engine)
                status(f"server ready at {url} (pid {proc.pid})")
                yield url
            finally:
                stop(proc, spec.stop_timeout_s)


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log_path: Path, name: str) -> None:
    """Poll GET /health until it answers 200; fail early, with the log's tail, if the process exits."""
    import httpx  # here: the bench's options (ServerSpec among them) are read by `llmopt --help`

    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            code = proc.poll()
            if code is not None:
                raise ServerError(f"the {name} server exited with code {code} before answering /health; "
                                  f"last lines of its output:\n{tail(log_path)}")
            try:
                if client.get(url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.25)
    raise ServerError(f"the {name} server did not answer /health within {timeout_s:g} s (raise --server-timeout); "
                      f"last lines of its output:\n{tail(log_path)}")


def stop(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """SIGTERM to the server's process group, then SIGKILL if it has not exited within the timeout."""
    if proc.poll() is not None:
        return proc.returncode
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)  # the group we created with start_new_session
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            last = deque((line.rstrip() for line in f), maxlen=lines)
    except OSError:
        return "  (no output captured)"
    return "\n".join(f"  | {line}" for line in last) or "  (no output)"
