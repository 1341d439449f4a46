"""llmopt serve against llama.cpp's llama-server on this CPU, side by side (`make bench-llamacpp`).

Every measurement is an `llmopt bench --server SOURCE --engine ...` run, so both servers see the same client,
the same prompts and the same settings, and each run starts its server afresh (which gives its start-up time
and peak memory). Rounds interleave the servers, so slow drift of a shared machine falls on all of them; the
table gives medians over rounds. Rows:

- concurrency 1 and 16 on ShareGPT prompts (64 output tokens, --ignore-eos): output tok/s, median TPOT/TTFT;
- a 512-token prompt (random token ids, 16 output tokens, one at a time): median TTFT;
- concurrency 1 again while a busy process spins on one core (`taskset -c 1`): the fall in output tok/s;
- ready after start (first /health 200) and peak RSS (VmHWM), from the concurrency-16 run.

    python scripts/bench_llamacpp.py --llama-server PATH --run NAME=SOURCE[:SERVE ARGS] ... --out DIR

The llama-server runs on the GGUF given by --gguf (default: the shipped smollm2-135m Q4_1) with
--llama-args; each --run is an llmopt serve source. Writes DIR/ROUND-NAME-ROW.json (the bench reports),
DIR/table.md and DIR/table.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

LLAMA = "llama-server"
LOAD = ["--dataset", "sharegpt", "--output-len", "64", "--ignore-eos", "--request-rate", "inf", "--warmup", "1",
        "--seed", "0", "--quiet"]
ROWS = {  # row -> the bench options that make it
    "c1": [*LOAD, "--num-prompts", "16", "--max-concurrency", "1"],
    "c16": [*LOAD, "--num-prompts", "32", "--max-concurrency", "16"],
    "p512": ["--dataset", "random", "--input-len", "512", "--tokenizer", "smollm2-135m", "--output-len", "16",
             "--ignore-eos", "--num-prompts", "6", "--max-concurrency", "1", "--warmup", "1", "--seed", "0", "--quiet"],
    # 4 requests: llama-server's spinning threads beside a busy core make 16 take about 37 minutes (0.46 tok/s)
    "c1-busy": [*LOAD, "--num-prompts", "4", "--max-concurrency", "1"],
}


@contextmanager
def busy_core(core: int):
    """A process spinning on one core for the block's duration (a co-tenant, as a CPU limit makes one)."""
    proc = subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def bench(name: str, source: str, engine: str, serve_args: str, row: str, out: Path, round_: int) -> dict:
    path = out / f"r{round_}-{name}-{row}.json"
    command = [sys.executable, "-m", "llmopt.cli.main", "bench", "--server", source, "--engine", engine,
               *ROWS[row], "--json", str(path)]
    if serve_args:
        command += ["--serve-args", serve_args]
    print(f"== round {round_}: {name} {row}", file=sys.stderr, flush=True)
    with busy_core(1) if row == "c1-busy" else _nothing():
        result = subprocess.run(command, stdout=subprocess.DEVNULL)
    if result.returncode != 0:
        raise SystemExit(f"bench of {name} ({row}) failed with exit code {result.returncode}")
    return json.loads(path.read_text())


@contextmanager
def _nothing():
    yield


def measure(runs: dict[str, tuple[str, str, str]], rounds: int, out: Path) -> dict[str, dict[str, list[dict]]]:
    """{name: {row: [report per round]}}, servers interleaved within each round."""
    reports: dict[str, dict[str, list[dict]]] = {name: {row: [] for row in ROWS} for name in runs}
    for round_ in range(1, rounds + 1):
        for row in ROWS:
            for name, (source, engine, args) in runs.items():
                reports[name][row].append(bench(name, source, engine, args, row, out, round_))
    return reports


def _median(reports: list[dict], key: str, section: str | None = None) -> float | None:
    values = [(r.get(section) or {}).get(key) if section else r.get(key) for r in reports]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def table(reports: dict[str, dict[str, list[dict]]], baseline: str = LLAMA) -> tuple[str, dict]:
    """The Markdown table (metrics down, servers across, each with its ratio to the baseline) and its data."""
    metrics = [  # label, row, key, section, higher is better
        ("concurrency 1, output tok/s", "c1", "output_throughput", None, True),
        ("concurrency 1, median TPOT ms", "c1", "median_tpot_ms", None, False),
        ("concurrency 16, output tok/s", "c16", "output_throughput", None, True),
        ("concurrency 16, median TTFT ms", "c16", "median_ttft_ms", None, False),
        ("512-token prompt, median TTFT ms", "p512", "median_ttft_ms", None, False),
        ("concurrency 1 beside a busy core, output tok/s", "c1-busy", "output_throughput", None, True),
        ("ready after start, s", "c16", "ready_s", "server", False),
        ("peak RSS (VmHWM), MB", "c16", "peak_rss_bytes", "server", False),
    ]
    names = sorted(reports, key=lambda n: (n != baseline, n))
    data = {name: {} for name in names}
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, row, key, section, _ in metrics:
        cells = []
        base = _median(reports[baseline][row], key, section) if baseline in reports else None
        for name in names:
            value = _median(reports[name][row], key, section)
            if key == "peak_rss_bytes" and value is not None:
                value /= 1e6
                base_shown = base / 1e6 if base else None
            else:
                base_shown = base
            data[name][label] = value
            text = "-" if value is None else f"{value:,.1f}" if value >= 10 else f"{value:,.2f}"
            if name != baseline and value is not None and base_shown:
                text += f" ({value / base_shown:.2f}x)"
            cells.append(text)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for name in names:  # the fall under a co-tenant, per server
        calm, busy = data[name]["concurrency 1, output tok/s"], data[name]["concurrency 1 beside a busy core, output tok/s"]
        data[name]["fall beside a busy core"] = None if not (calm and busy) else 1 - busy / calm
    lines.append("| fall beside a busy core | " + " | ".join(
        "-" if data[n]["fall beside a busy core"] is None else f"{100 * data[n]['fall beside a busy core']:.0f}%"
        for n in names) + " |")
    return "\n".join(lines), data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                        help="llama-server binary (default $LLAMA_SERVER); without it, llmopt's runs only")
    parser.add_argument("--gguf", default="smollm2-135m", help="the GGUF llama-server loads")
    parser.add_argument("--llama-args", default="-t 2 -np 16 -c 32768 --kv-unified --no-repack")
    parser.add_argument("--run", action="append", default=[], metavar="NAME=SOURCE[:SERVE ARGS]")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-results/llamacpp"))
    args = parser.parse_args(argv)
    runs: dict[str, tuple[str, str, str]] = {}
    if args.llama_server:
        os.environ["LLAMA_SERVER"] = args.llama_server
        runs[LLAMA] = (args.gguf, "llama-server", args.llama_args)
    for spec in args.run:
        name, _, rest = spec.partition("=")
        source, _, serve_args = rest.partition(":")
        if not name or not source:
            parser.error(f"--run {spec!r}: write NAME=SOURCE or NAME=SOURCE:SERVE ARGS")
        runs[name] = (source, "llmopt", " ".join(shlex.split(serve_args)))
    if not runs:
        parser.error("nothing to run: give --llama-server and/or --run")
    args.out.mkdir(parents=True, exist_ok=True)
    reports = measure(runs, args.rounds, args.out)
    text, data = table(reports)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "table.json").write_text(json.dumps({"runs": {n: list(r) for n, r in runs.items()}, "rounds": args.rounds,
                                                     "medians": data}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
