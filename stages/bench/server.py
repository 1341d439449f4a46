"""--server SOURCE: start a server as a subprocess on a free loopback port, wait for /health, stop it.

The engine is `llmopt serve` (default) or, for baselines, the plain-transformers server
(`--engine hf`: `python -m llmopt.stages.serve.baseline`, started by its module name, so the bench
still imports nothing of the engine) or llama.cpp's server (`--engine llama-server`: the binary named by
`$LLAMA_SERVER`, else `llama-server` on PATH, on a GGUF file or a GGUF alias such as smollm2-135m; its own
options go in `--serve-args`). Its output goes to a log file whose last lines explain a server that dies or
never becomes healthy. With a gRPC port (`--grpc auto`), `llmopt serve` gets `--grpc-port` on a second free
port, and the server is ready once /health answers and that port answers a gRPC call.

What a person running a server notices is measured on the way: seconds from the start to the first
`/health` 200 (`ready_s`) and the process's peak resident memory (`peak_rss_bytes`, the kernel's VmHWM,
read just before it is stopped), both kept in the report's `server` section.
"""
from __future__ import annotations

import os
import shutil
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
ENGINES = ("llmopt", "hf", "llama-server")
LLAMA_SERVER_ENV = "LLAMA_SERVER"  # the llama-server binary for --engine llama-server (else PATH)
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
    grpc_port: int | None = None  # also serve the gRPC API on this port (llmopt serve --grpc-port)

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine {self.engine}: use llmopt, hf or llama-server")
        if self.startup_timeout_s <= 0:
            raise ConfigError("--server-timeout must be positive")
        if self.grpc_port is not None and self.engine != "llmopt":
            raise ConfigError(f"--grpc auto: only --engine llmopt serves gRPC; bench --engine {self.engine} "
                              "over HTTP (without --grpc)")

    @property
    def grpc_target(self) -> str | None:
        """HOST:PORT of the server's gRPC API; None when it serves none."""
        return None if self.grpc_port is None else f"{self.host}:{self.grpc_port}"

    def command(self, port: int) -> list[str]:
        if self.engine == "llama-server":
            return [llama_server_binary(), "-m", gguf_file(self.source), "--host", self.host, "--port", str(port),
                    *self.args]
        if self.engine == "hf":
            head = [sys.executable, "-m", BASELINE_MODULE, self.source]
        else:
            # Nothing balances load onto a server bench started itself: no grace window when it stops
            # (given first, so --serve-args can still set one).
            head = [sys.executable, "-m", "llmopt.cli.main", "serve", self.source, "--drain-grace", "0"]
            if self.grpc_port is not None:
                head += ["--grpc-port", str(self.grpc_port)]
        return [*head, "--port", str(port), *self.args]

    def describe(self) -> dict:
        return {"source": self.source, "engine": self.engine, "args": list(self.args)}


def llama_server_binary() -> str:
    """The llama-server executable: `$LLAMA_SERVER`, else `llama-server` on PATH; a one-line error without one."""
    given = os.environ.get(LLAMA_SERVER_ENV)
    found = given or shutil.which("llama-server")
    if not found:
        raise ConfigError("--engine llama-server: no llama-server binary; set $LLAMA_SERVER to its path "
                          "(docs/bench.md says how to build it) or put it on PATH")
    if not (os.path.isfile(found) and os.access(found, os.X_OK)):
        raise ConfigError(f"${LLAMA_SERVER_ENV}={found}: not an executable file")
    return found


def gguf_file(source: str) -> str:
    """The GGUF file llama-server loads for `source`: a .gguf path or a built-in alias's file."""
    from ..source import resolve  # here: resolving an alias locates its package, which --help need not do

    resolved = resolve(source)
    if resolved.kind not in ("alias", "gguf"):
        raise ConfigError(f"--engine llama-server: {source} is a model directory; llama-server loads a .gguf file "
                          "or an alias such as smollm2-135m")
    return str(resolved.path)


def peak_rss_bytes(pid: int) -> int | None:
    """The process's peak resident set (VmHWM) in bytes, or None where /proc does not say (not Linux, gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextmanager
def running_server(spec: ServerSpec, status: Callable[[str], None] = lambda message: None,
                   stats: dict | None = None) -> Iterator[str]:
    """Yields the base URL of a healthy server; stops it (SIGTERM, then SIGKILL) however the block ends.
    `stats`, when given, gets `ready_s` once it is healthy and `peak_rss_bytes` just before it is stopped."""
    spec.validate()
    stats = {} if stats is None else stats
    command = spec.command(free_port(spec.host))  # a missing binary or a wrong source fails before anything runs
    port = int(command[command.index("--port") + 1])
    with tempfile.TemporaryDirectory(prefix="llmopt-bench-") as tmp:
        log_path = Path(tmp) / "server.log"
        with open(log_path, "wb") as log:
            status(f"starting {' '.join(command[1:])}")
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            # Its own session: a Ctrl-C in the terminal reaches us, and we stop the server in order.
            started = time.monotonic()
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
            try:
                url = f"http://{spec.host}:{port}"
                wait_healthy(proc, url, spec.startup_timeout_s, log_path, spec.engine)
                if spec.grpc_target:
                    left = spec.startup_timeout_s - (time.monotonic() - started)
                    wait_grpc(proc, spec.grpc_target, left, log_path)
                stats["ready_s"] = round(time.monotonic() - started, 3)
                grpc_note = f", gRPC at {spec.grpc_target}" if spec.grpc_target else ""
                status(f"server ready at {url}{grpc_note} (pid {proc.pid}) after {stats['ready_s']:.2f} s")
                yield url
            finally:
                stats["peak_rss_bytes"] = peak_rss_bytes(proc.pid)
                stop(proc, spec.stop_timeout_s)


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log_path: Path, name: str) -> None:
    """Poll GET /health until it answers 200; fail early, with the log's tail, if the process exits."""
    import httpx  # here: the bench's options (ServerSpec among them) are read by `llmopt --help`

    with httpx.Client(timeout=2.0) as client:
        def healthy() -> bool:
            try:
                return client.get(url + "/health").status_code == 200
            except httpx.HTTPError:
                return False  # not listening yet

        _poll(proc, healthy, timeout_s, log_path, f"the {name} server", "answering /health",
              f"did not answer /health within {timeout_s:g} s (raise --server-timeout)")


def wait_grpc(proc: subprocess.Popen, target: str, timeout_s: float, log_path: Path) -> None:
    """Call ListModels on the server's gRPC port until it answers (any status but UNAVAILABLE or a timeout: a
    refused key is an answer too); fail early, with the log's tail, if the process exits."""
    import grpc  # here: only a server started with a gRPC port needs it

    from ..grpc_api import generate_pb2, generate_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        list_models = generate_pb2_grpc.GenerationStub(channel).ListModels

        def answers() -> bool:
            try:
                list_models(generate_pb2.ListModelsRequest(), timeout=1.0)
            except grpc.RpcError as e:
                return e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            return True

        _poll(proc, answers, max(timeout_s, 1.0), log_path, "the llmopt server", f"its gRPC port {target} answered",
              f"did not answer on its gRPC port {target} within the --server-timeout")


def _poll(proc: subprocess.Popen, ready: Callable[[], bool], timeout_s: float, log_path: Path, who: str,
          waiting_for: str, too_slow: str) -> None:
    """Call `ready()` every 20 ms until it is true; ServerError with the log's tail if the process exits first
    (`who` exited ... before `waiting_for`) or `timeout_s` passes (`who` `too_slow`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise ServerError(f"{who} exited with code {code} before {waiting_for}; last lines of its output:\n"
                              f"{tail(log_path)}")
        if ready():
            return
        time.sleep(0.02)  # finely: the wait is the start-up time the report gives
    raise ServerError(f"{who} {too_slow}; last lines of its output:\n{tail(log_path)}")


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
