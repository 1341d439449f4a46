"""`llmopt serve` on a pipeline-sharded artifact: each stage is a process; killing one mid-stream ends the
stream with an error frame and [DONE], /health turns 503, and the server exits 2 within seconds, naming the
rank, with no rank process left behind."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from llmopt.stages.shard.config import ShardConfig
from llmopt.stages.shard.run import run_shard
from tests.helpers import write_hf_dir
from tests.stages.serve.http.test_cli_serve import free_port
from tests.stages.shard.test_tp_serve import _health_after_kill, children, wait_ready


def test_killed_stage_ends_the_stream_and_the_server(tmp_path):
    write_hf_dir(tmp_path / "base", layers=5, hidden=96, heads=6, kv_heads=2)
    art = run_shard(str(tmp_path / "base"), tmp_path / "pp3", ShardConfig(pp=3))
    port = free_port()
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "llmopt.cli.main", "serve", str(art.path), "--port", str(port),
               "--block-size", "4", "--max-model-len", "512", "--max-num-seqs", "4"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    frames: list[str] = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            wait_ready(client, proc)
            ok = client.post("/v1/completions", json={"prompt": "the quick", "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
            ranks = children(proc.pid)
            assert len(ranks) == 2  # stages 1 and 2; stage 0 runs in the server's process
            streaming = threading.Thread(target=_stream, args=(port, frames), daemon=True)
            streaming.start()
            deadline = time.time() + 30
            while len(frames) < 3 and time.time() < deadline:  # tokens are flowing through every stage
                time.sleep(0.02)
            last = ranks[-1]
            os.kill(last, signal.SIGKILL)
            killed = time.time()
            health = _health_after_kill(client)
        code = proc.wait(20)
        elapsed = time.time() - killed
        streaming.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    assert code == 2 and elapsed < 15, (code, elapsed, stderr[-2000:])
    assert f"pipeline-parallel rank 2 (pid {last}) was killed by SIGKILL" in stderr
    assert health in (503, None)  # 503, or the server had already closed its socket
    errors = [f for f in frames if f != "[DONE]" and "error" in json.loads(f)]
    assert errors and frames[-1] == "[DONE]", frames[-3:]
    assert all(not _alive(pid) for pid in ranks)  # no rank left behind


def _stream(port: int, frames: list[str]) -> None:
    body = {"prompt": "the quick brown fox", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with contextlib.suppress(httpx.HTTPError):  # the server going away mid-stream: the frames so far are the record
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    frames.append(line[len("data: "):])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone, only not yet reaped
        return f.read().split(") ", 1)[1][0] != "Z"


def test_two_nodes_on_loopback_serve_one_pipeline(tmp_path):
    """`--nnodes 2`: node 1 runs stage 1, node 0 stage 0 and the server; the answer is one process's, and when
    node 0 drains and exits, node 1 ends too."""
    from llmopt.stages.serve.build import build_engine
    from llmopt.stages.serve.engine.config import EngineConfig, SamplingParams

    write_hf_dir(tmp_path / "base", layers=4, hidden=96, heads=6, kv_heads=2)
    art = run_shard(str(tmp_path / "base"), tmp_path / "pp2", ShardConfig(pp=2))
    one = build_engine(str(tmp_path / "base"), EngineConfig(block_size=4, num_blocks=64), "cpu", backend="reference")
    expected = one.generate(["the quick brown fox"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    port, master = free_port(), free_port()
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    nodes = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(master), "--backend", "reference"]
    serve = [sys.executable, "-m", "llmopt.cli.main", "serve", str(art.path)]
    node1 = subprocess.Popen([*serve, "--node-rank", "1", *nodes], env=env, stderr=subprocess.PIPE, text=True)
    node0 = subprocess.Popen([*serve, "--node-rank", "0", *nodes, "--port", str(port), "--block-size", "4",
                              "--max-model-len", "256", "--max-num-seqs", "4", "--drain-grace", "0"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            wait_ready(client, node0)
            body = {"prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            answer = client.post("/v1/completions", json=body).json()
        assert answer["choices"][0]["text"] == expected[0].text
        node0.send_signal(signal.SIGTERM)
        assert node0.wait(30) == 0
        assert node1.wait(30) == 0, node1.stderr.read()[-2000:]
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                proc.kill()
