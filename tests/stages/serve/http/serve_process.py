"""`llmopt serve` as a real process on a free loopback port, for what the process does itself: drain on
a signal, connection limits, the lines it prints. Its stderr goes to a file (a pipe could fill up)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

# `python -c LAUNCHER DELAY serve ...`: the command's own main, with every engine step made DELAY seconds
# slower, so that a request on the tiny model outlasts a drain timeout of a second.
LAUNCHER = """
import sys, time
from llmopt.stages.serve.runner import ModelRunner
delay, execute = float(sys.argv.pop(1)), ModelRunner.execute
def slow(self, *args, **kwargs):
    time.sleep(delay)
    return execute(self, *args, **kwargs)
ModelRunner.execute = slow
from llmopt.cli.main import main
sys.exit(main(sys.argv[1:]))
"""
TINY = ["--served-model-name", "tiny", "--block-size", "4", "--kv-cache-memory", "16MiB", "--max-model-len", "128",
        "--max-num-seqs", "4"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    def __init__(self, proc: subprocess.Popen, port: int, stderr: Path):
        self.proc, self.port, self.stderr_path = proc, port, stderr
        self.base_url = f"http://127.0.0.1:{port}"

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=30, **kw)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self.client() as client:
                    if client.get("/health").status_code == 200:
                        return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the server did not become healthy:\n{self.stderr}")
            time.sleep(0.1)

    def terminate(self) -> float:
        """SIGTERM; the monotonic time it was sent."""
        self.proc.send_signal(signal.SIGTERM)
        return time.monotonic()


@contextmanager
def serve_process(source, *args: str, step_delay: float = 0.0, tmp_path: Path, healthy: bool = True):
    """`llmopt serve SOURCE --port P *args` (with the tiny model's engine options); killed on exit if it
    is still running."""
    port = free_port()
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    head = [sys.executable, "-c", LAUNCHER, str(step_delay)] if step_delay else [sys.executable, "-m",
                                                                                  "llmopt.cli.main"]
    stderr = tmp_path / f"serve-{port}.err"
    with open(stderr, "w") as err:
        proc = subprocess.Popen([*head, "serve", str(source), "--port", str(port), *TINY, *args], env=env,
                                stdout=subprocess.DEVNULL, stderr=err, text=True)
    server = ServeProcess(proc, port, stderr)
    try:
        if healthy:
            server.wait_healthy()
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
