"""`llmopt serve` as a process: ready on /health, drains an in-flight stream on SIGTERM, exits 0."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_drains_on_sigterm_and_exits_0(model_dir):
    port = free_port()
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "llmopt.cli.main", "serve", str(model_dir), "--port", str(port),
               "--served-model-name", "tiny", "--block-size", "4", "--kv-cache-memory", "16MiB",
               "--max-model-len", "128", "--max-num-seqs", "4", "--log-json", "--drain-grace", "0.2", "--drain-timeout", "20"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            deadline = time.time() + 60
            while True:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
                time.sleep(0.1)
            body = {"prompt": "the quick brown fox", "max_tokens": 110, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                proc.send_signal(signal.SIGTERM)  # mid-stream: the request must still finish
                rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    assert '"path": "/v1/completions", "status": 200' in stderr  # the JSON access log line


@pytest.mark.parametrize("argv, expect", [
    (["serve", "/no/such/model"], "no such"),
    (["serve", "smollm2-135m", "--port", "70000"], "--port"),
    (["serve", "smollm2-135m", "--drain-timeout", "-1"], "--drain-timeout"),
    (["serve", "smollm2-135m", "--drain-grace", "-1"], "--drain-grace"),
    (["serve", "smollm2-135m", "--header-timeout", "0"], "--header-timeout"),
    (["serve", "smollm2-135m", "--keep-alive-timeout", "0"], "--keep-alive-timeout"),
    (["serve", "smollm2-135m", "--max-num-seqs", "64", "--max-num-batched-tokens", "8"], "--max-num-batched-tokens"),
])
def test_serve_refuses_bad_options_at_once(argv, expect, capsys):
    from llmopt.cli.main import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and expect in err
