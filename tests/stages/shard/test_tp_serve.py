"""`llmopt serve` on a sharded artifact: its ranks are processes; when one dies mid-request, /health
turns 503 and the server exits non-zero within seconds, naming the rank."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from llmopt.stages.shard.config import ShardConfig
from llmopt.stages.shard.run import run_shard
from tests.helpers import write_hf_dir
from tests.stages.serve.http.test_cli_serve import free_port


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def wait_ready(client: httpx.Client, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while True:
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "not ready"
        time.sleep(0.2)


def test_killed_rank_stops_the_server(tmp_path):
    write_hf_dir(tmp_path / "base", hidden=96, heads=6, kv_heads=2)
    art = run_shard(str(tmp_path / "base"), tmp_path / "tp2", ShardConfig(2))
    port = free_port()
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "llmopt.cli.main", "serve", str(art.path), "--port", str(port),
               "--block-size", "4", "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--max-num-seqs", "4"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            wait_ready(client, proc)
            ok = client.post("/v1/completions", json={"prompt": "the quick", "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
            [worker] = children(proc.pid)
            streaming = threading.Thread(target=_long_stream, args=(port,), daemon=True)
            streaming.start()
            time.sleep(0.5)
            os.kill(worker, signal.SIGKILL)
            killed = time.time()
            health = _health_after_kill(client)
        code = proc.wait(20)
        elapsed = time.time() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    assert code != 0 and elapsed < 15
    assert f"rank 1 (pid {worker}) was killed by SIGKILL" in stderr
    assert health in (503, None)  # 503, or the server had already closed its socket


def _long_stream(port: int) -> None:
    body = {"prompt": "the quick brown fox", "max_tokens": 240, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as r:
            for _ in r.iter_lines():
                pass
    except httpx.HTTPError:
        pass


def _health_after_kill(client: httpx.Client) -> int | None:
    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            status = client.get("/health", timeout=2).status_code
        except httpx.TransportError:
            return None
        if status == 503:
            return status
        time.sleep(0.05)
    return 200
