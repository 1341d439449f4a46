"""The performance gate `.ci/run` runs after `make test` (`make bench-ci`, docs/ci.md):

    python scripts/bench_ci.py --llmopt ART --baseline ART [--rounds 2] [--min-ratio M=X]... [--max-ratio M=X]...
                               [--max-rss-mib N] [--out DIR] [--load "BENCH OPTIONS"]

`llmopt bench --server` on the llmopt artifact (smollm2-135m W4A16) and on the baseline (transformers' own server,
`--engine hf`, on the float artifact), the same small load, alternating (llmopt, hf, llmopt, hf: a machine that
slows down part-way slows both), then each side's median over its rounds. The gate is on ratios measured in this
run, llmopt over the baseline, never on absolute figures: a shared CI machine moves absolute numbers several-fold
between runs, and both sides move together. `llmopt bench compare BASELINE LLMOPT --min-ratio ... --max-ratio
...` decides (the command users run), and the llmopt server's peak RSS is held to --max-rss-mib (memory is not
noisy). Writes DIR/ENGINE-rN.json (every run), DIR/llmopt.json and DIR/baseline.json (the medians), DIR/ci.md
(the table, also printed); exits 1 when a bound fails.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

LLMOPT = [sys.executable, "-m", "llmopt.cli.main"]
LOAD = ("--dataset sharegpt --num-prompts 8 --output-len 32 --ignore-eos --request-rate inf --max-concurrency 4 "
        "--warmup 1 --seed 0 --quiet")
# The figures the gate reads, with the direction that is better; every other metric is reported, not gated.
GATED = {"output_throughput": "higher", "median_ttft_ms": "lower", "median_tpot_ms": "lower"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llmopt", required=True, help="the artifact llmopt serves")
    parser.add_argument("--baseline", required=True, help="the artifact the baseline engine serves")
    parser.add_argument("--baseline-engine", default="hf")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--min-ratio", action="append", default=[], metavar="METRIC=X")
    parser.add_argument("--max-ratio", action="append", default=[], metavar="METRIC=X")
    parser.add_argument("--max-rss-mib", type=float, default=None, help="the llmopt server's peak RSS bound")
    parser.add_argument("--load", default=LOAD, help="llmopt bench options for both sides")
    parser.add_argument("--serve-args", default="", help="llmopt serve options for the llmopt side (e.g. the KV "
                        "cache's size, which is most of its RSS)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/ci"))
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds takes a positive number")
    return args


def order(rounds: int, baseline_engine: str) -> list[tuple[str, int]]:
    """(side, round) in the order they run: llmopt then the baseline, each round."""
    return [(side, r) for r in range(1, rounds + 1) for side in ("llmopt", baseline_engine)]


def median_report(reports: list[dict]) -> dict:
    """The first report with every numeric metric replaced by its median over `reports`, the server's peak RSS by
    its maximum, and the per-round values kept under `rounds`."""
    out = dict(reports[0])
    for key, value in reports[0].items():
        values = [r.get(key) for r in reports]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                all(isinstance(v, (int, float)) for v in values):
            out[key] = statistics.median(values)
    rss = [(r.get("server") or {}).get("peak_rss_bytes") for r in reports]
    if all(isinstance(v, int) for v in rss):
        out["server"] = {**(reports[0].get("server") or {}), "peak_rss_bytes": max(rss)}
    out["rounds"] = {m: [r.get(m) for r in reports] for m in GATED}
    return out


def peak_rss_mib(report: dict) -> float | None:
    rss = (report.get("server") or {}).get("peak_rss_bytes")
    return None if rss is None else rss / 2**20


def table(ours: dict, base: dict, engine: str, bounds: dict[str, str], max_rss_mib: float | None) -> str:
    """Markdown: each gated metric's rounds, medians, the ratio and its bound; then the llmopt server's peak RSS."""
    lines = [f"| metric | llmopt rounds | {engine} rounds | llmopt | {engine} | ratio | bound |", "|---|---|---|---|---|---|---|"]
    for metric in GATED:
        a, b = ours.get(metric), base.get(metric)
        ratio = a / b if a is not None and b else None
        lines.append(f"| {metric} | {_list(ours['rounds'][metric])} | {_list(base['rounds'][metric])} | {_num(a)} | "
                     f"{_num(b)} | {'-' if ratio is None else f'{ratio:.3f}'} | {bounds.get(metric, '-')} |")
    rss, base_rss = peak_rss_mib(ours), peak_rss_mib(base)
    lines.append(f"| server peak RSS MiB | | | {_num(rss, 0)} | {_num(base_rss, 0)} | | "
                 f"{'-' if max_rss_mib is None else f'<= {max_rss_mib:g}'} |")
    return "\n".join(lines)


def bound_texts(min_ratio: list[str], max_ratio: list[str]) -> dict[str, str]:
    """{metric: '>= X' or '<= X'} from --min-ratio / --max-ratio items (comma lists allowed)."""
    out = {}
    for items, op in ((min_ratio, ">="), (max_ratio, "<=")):
        for item in ",".join(items).split(","):
            if "=" in item:
                metric, value = item.split("=", 1)
                out[metric.strip().replace("p50_", "median_")] = f"{op} {value.strip()}"
    return out


def rss_problem(report: dict, max_rss_mib: float | None) -> str | None:
    rss = peak_rss_mib(report)
    if max_rss_mib is None:
        return None
    if rss is None:
        return "the llmopt server's peak RSS was not measured (no /proc?), so --max-rss-mib cannot hold"
    if rss > max_rss_mib:
        return f"the llmopt server's peak RSS {rss:.0f} MiB is above the bound {max_rss_mib:g} MiB"
    return None


def _list(values) -> str:
    return ", ".join(_num(v) for v in values)


def _num(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def bench(source: str, engine: str, load: str, path: Path, serve_args: str = "") -> dict:
    cmd = [*LLMOPT, "bench", "--server", source, "--engine", engine, *shlex.split(load), "--json", str(path)]
    if serve_args:
        cmd += ["--serve-args", serve_args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd[2:])} failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(path.read_text())


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    start, runs = time.perf_counter(), {"llmopt": [], args.baseline_engine: []}
    for side, r in order(args.rounds, args.baseline_engine):
        source = args.llmopt if side == "llmopt" else args.baseline
        print(f"== {side} on {source}, round {r} ({time.perf_counter() - start:.0f} s so far)", file=sys.stderr,
              flush=True)
        serve_args = args.serve_args if side == "llmopt" else ""
        runs[side].append(bench(source, side, args.load, args.out / f"{side}-r{r}.json", serve_args))
    ours, base = median_report(runs["llmopt"]), median_report(runs[args.baseline_engine])
    (args.out / "llmopt.json").write_text(json.dumps(ours, indent=1))
    (args.out / "baseline.json").write_text(json.dumps(base, indent=1))
    text = (f"make bench-ci: llmopt ({args.llmopt}{', ' + args.serve_args if args.serve_args else ''}) against "
            f"{args.baseline_engine} ({args.baseline}), medians of {args.rounds} alternating rounds; load: {args.load}\n\n"
            + table(ours, base, args.baseline_engine, bound_texts(args.min_ratio, args.max_ratio), args.max_rss_mib))
    (args.out / "ci.md").write_text(text + "\n")
    print(text, flush=True)
    compare = [*LLMOPT, "bench", "compare", str(args.out / "baseline.json"), str(args.out / "llmopt.json"),
               *(f"--min-ratio={b}" for b in args.min_ratio), *(f"--max-ratio={b}" for b in args.max_ratio),
               *(f"--metric={m}" for m in GATED)]
    gate = subprocess.run(compare)
    problem = rss_problem(ours, args.max_rss_mib)
    if problem:
        print(f"bench-ci: {problem}", file=sys.stderr)
    failed = gate.returncode != 0 or problem is not None
    print(f"bench-ci: {'FAILED' if failed else 'passed'} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
