"""gRPC against HTTP on one server, one run (`make bench-grpc`, docs/grpc.md):

    python scripts/bench_grpc.py SOURCE... [--rounds 3] [--concurrency 16] [--num-prompts 64] [--output-len 64]

For each SOURCE (an artifact, or `synthetic-tiny`: `llmopt profile --synthetic tiny --save-model`'s 2-layer random
model, 1.4 M parameters, served in fp32, where the engine's work per token is small enough for the protocol's
cost to show) it starts one `llmopt serve SOURCE --grpc-port` (one process, both APIs over the same engine), then benches it
with `llmopt bench` over HTTP (`--url`, SSE) and over gRPC (`--grpc`, GenerateStream) under the same load:
ShareGPT prompts, concurrency C, OUTPUT_LEN tokens each with EOS ignored, greedy. Rounds alternate which protocol
goes first. Around every bench the server process's CPU time (user + system, every thread: /proc/PID/stat) is
read, so each run gets the server's CPU milliseconds per output token: what the protocol costs the server on top
of the same engine work. The table gives each protocol's medians over the rounds (median ITL, TPOT, TTFT,
output throughput, server CPU per token) and gRPC's ratio to HTTP's.

Writes DIR/NAME/*.json (every report), DIR/grpc.md (the tables) and prints them.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

LLMOPT = [sys.executable, "-m", "llmopt.cli.main"]
PROTOCOLS = ("http", "grpc")
METRICS = (("median_itl_ms", "median ITL ms"), ("median_tpot_ms", "median TPOT ms"),
           ("median_ttft_ms", "median TTFT ms"), ("output_throughput", "output tok/s"),
           ("server_cpu_ms_per_token", "server CPU ms / token"))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", help="what to serve: artifacts, or synthetic-tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench-results/grpc"))
    args = parser.parse_args(argv)
    if min(args.rounds, args.concurrency, args.num_prompts, args.output_len) < 1:
        parser.error("--rounds, --concurrency, --num-prompts and --output-len take positive numbers")
    return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` and all its threads so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def order(round_index: int) -> tuple[str, ...]:
    """The protocols in round `round_index`'s order: each goes first in every other round."""
    return PROTOCOLS if round_index % 2 == 0 else PROTOCOLS[::-1]


def bench_command(protocol: str, http_port: int, grpc_port: int, args, out: Path, name: str) -> list[str]:
    target = ["--url", f"http://127.0.0.1:{http_port}"] if protocol == "http" else \
        ["--grpc", f"127.0.0.1:{grpc_port}"]
    return [*LLMOPT, "bench", *target, "--dataset", "sharegpt", "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.concurrency), "--output-len", str(args.output_len), "--ignore-eos",
            "--temperature", "0", "--quiet", "--save-result", "--result-dir", str(out), "--result-filename", name]


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Each protocol's median of every metric over its runs."""
    return {protocol: {key: statistics.median(run[key] for run in reports) for key, _ in METRICS}
            for protocol, reports in runs.items() if reports}


def table(runs: dict[str, list[dict]]) -> str:
    medians = summarize(runs)
    lines = ["| protocol | " + " | ".join(label for _, label in METRICS) + " |",
             "|---|" + "---|" * len(METRICS)]
    for protocol in PROTOCOLS:
        if protocol in medians:
            lines.append(f"| {protocol} | " + " | ".join(f"{medians[protocol][k]:.2f}" for k, _ in METRICS) + " |")
    if len(medians) == 2:
        lines.append("| grpc / http | " + " | ".join(f"{medians['grpc'][k] / medians['http'][k]:.3f}x"
                                                      for k, _ in METRICS) + " |")
    lines += ["", "Every run (" + ", ".join(label for _, label in METRICS) + "):"]
    for protocol in PROTOCOLS:
        for i, run in enumerate(runs.get(protocol, [])):
            lines.append(f"- {protocol} round {i + 1}: " + ", ".join(f"{run[k]:.2f}" for k, _ in METRICS))
    return "\n".join(lines)


def wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server was not healthy within {timeout_s:g} s")


SYNTHETIC = "synthetic-tiny"


def serve_args(source: str, out: Path) -> tuple[str, list[str]]:
    """The path to serve for `source` (synthetic-tiny: written into `out` first) and its extra serve options."""
    if source != SYNTHETIC:
        return source, []
    path = out / "synthetic-tiny-model"
    if not (path / "llmopt.json").is_file():
        subprocess.run([*LLMOPT, "profile", "--synthetic", "tiny", "--save-model", str(path)], check=True,
                       stdout=subprocess.DEVNULL)
    return str(path), ["--dtype", "fp32"]


def bench_source(source: str, args, out: Path) -> dict[str, list[dict]]:
    """Serve `source` with both APIs and bench it over each, alternating; every run's report."""
    out.mkdir(parents=True, exist_ok=True)
    path, extra = serve_args(source, args.out)
    http_port, grpc_port = free_port(), free_port()
    log = open(out / "server.log", "w")
    server = subprocess.Popen([*LLMOPT, "serve", path, "--port", str(http_port), "--grpc-port", str(grpc_port),
                               "--max-num-seqs", str(args.concurrency), "--drain-grace", "0", *extra],
                              stdout=log, stderr=subprocess.STDOUT)
    runs: dict[str, list[dict]] = {p: [] for p in PROTOCOLS}
    try:
        wait_healthy(server, http_port)
        for protocol in PROTOCOLS:  # untimed: both paths warm (imports, the first stream of each)
            subprocess.run(bench_command(protocol, http_port, grpc_port, args, out, f"warmup-{protocol}.json")
                           + ["--num-prompts", str(args.concurrency)], check=True, stdout=subprocess.DEVNULL)
        for r in range(args.rounds):
            for protocol in order(r):
                name = f"{protocol}-round{r + 1}.json"
                print(f"== {source}: round {r + 1}/{args.rounds}, {protocol}", flush=True)
                before = cpu_seconds(server.pid)
                subprocess.run(bench_command(protocol, http_port, grpc_port, args, out, name), check=True,
                               stdout=subprocess.DEVNULL)
                spent = cpu_seconds(server.pid) - before
                report = json.loads((out / name).read_text())
                if report["failed"]:
                    raise SystemExit(f"{out / name}: {report['failed']} requests failed")
                report["server_cpu_ms_per_token"] = 1000 * spent / report["total_output_tokens"]
                (out / name).write_text(json.dumps(report, indent=1))
                runs[protocol].append(report)
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    return runs


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sections = []
    for source in args.sources:
        runs = bench_source(source, args, args.out / Path(source).name)
        sections.append(f"### {source}\n\n`llmopt serve {source} --grpc-port`, `llmopt bench` over HTTP and gRPC: "
                        f"ShareGPT, {args.num_prompts} prompts, concurrency {args.concurrency}, {args.output_len} "
                        f"output tokens, {args.rounds} rounds (medians)\n\n" + table(runs))
        print(sections[-1], flush=True)
    (args.out / "grpc.md").write_text("\n\n".join(sections) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
