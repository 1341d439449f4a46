"""Pipeline against tensor parallelism on this machine, one run (`make bench-pp`, docs/shard.md):

    python scripts/bench_pipeline.py BASE [--rounds 3] [--concurrency 16] [--pp-layers 0-16,17-29] [--out DIR]

BASE is an unsharded artifact (make's out/bench/base: smollm2-135m imported in fp32). The script shards it
with `llmopt shard --pp 2` and `--tp 2` (into DIR, kept for the next run), then serves each of PP1 (BASE
itself), PP2 and TP2 (and with --pp-layers, PP2 split there: "pp2-layers") with `llmopt bench --server` under the
same load: ShareGPT, --num-prompts 2 x concurrency,
64 output tokens, EOS ignored, --max-num-seqs equal to the concurrency. Each process group gets the machine's
cores: PP1 one process with every core's threads, PP2 and TP2 one rank per core (serve's launcher splits the
usable CPUs among the local ranks). Rounds rotate the order of the setups; the table gives each one's median
output throughput and its ratio to PP1's, then `llmopt profile --batch-sizes 1,C` on each pipeline measures each
stage's time per step and bubble (the share of its time it waits for its input) at that batch.

Writes DIR/*.json (every report) and DIR/pipeline.md (the table), and prints the table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

LLMOPT = [sys.executable, "-m", "llmopt.cli.main"]
SHARD_ARGS = {"pp2": ["--pp", "2"], "tp2": ["--tp", "2"]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="an unsharded artifact (fp32 smollm2-135m: make's out/bench/base)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--pp-layers", help="also PP2 with these stages (llmopt shard --pp-layers), as pp2-layers")
    parser.add_argument("--out", type=Path, default=Path("bench-results/pipeline"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.concurrency < 1 or args.output_len < 1:
        parser.error("--rounds, --concurrency and --output-len take positive numbers")
    return args


def shard_args(pp_layers: str | None) -> dict[str, list[str]]:
    """Each sharded setup's `llmopt shard` flags."""
    extra = {"pp2-layers": ["--pp", "2", "--pp-layers", pp_layers]} if pp_layers else {}
    return {**SHARD_ARGS, **extra}


def artifacts(base: Path, out: Path, pp_layers: str | None = None) -> dict[str, Path]:
    """PP1 is the base; the others are sharded from it into `out` (once: kept while their manifest is there and
    says the same split, made by the same flags and defaults)."""
    paths = {"pp1": base}
    for name, flags in shard_args(pp_layers).items():
        path = out / "artifacts" / name
        manifest = path / "llmopt.json"
        if not manifest.is_file() or json.loads(manifest.read_text())["config"] != shard_config(flags):
            subprocess.run([*LLMOPT, "shard", str(base), *flags, "-o", str(path), "--force", "--json"], check=True,
                           stdout=subprocess.DEVNULL)
        paths[name] = path
    return paths


def shard_config(flags: list[str]) -> dict:
    """The config `llmopt shard` records in the manifest for these flags (today's defaults for the rest)."""
    from llmopt.stages.shard.config import ShardConfig

    values = dict(zip(flags[0::2], flags[1::2]))
    return ShardConfig(tp=int(values.get("--tp", 1)), pp=int(values.get("--pp", 1)),
                       pp_layers=values.get("--pp-layers")).to_dict()


def bench_command(artifact: Path, concurrency: int, output_len: int, report: Path) -> list[str]:
    load = ["--dataset", "sharegpt", "--num-prompts", str(2 * concurrency), "--output-len", str(output_len),
            "--ignore-eos", "--request-rate", "inf", "--warmup", "1", "--seed", "0", "--quiet",
            "--max-concurrency", str(concurrency)]
    serve = f"--max-num-seqs {concurrency} --max-model-len 2048"
    return [*LLMOPT, "bench", "--server", str(artifact), *load, "--serve-args", serve, "--json", str(report)]


def rotation(setups: list[str], rounds: int) -> list[list[str]]:
    """The order of the setups in each round: rotated, so none always runs first on a fresh machine."""
    return [setups[r % len(setups):] + setups[:r % len(setups)] for r in range(rounds)]


def summarize(throughputs: dict[str, list[float]], profiles: dict[str, dict]) -> dict:
    """Medians and ratios to PP1, and each profiled pipeline's stages."""
    medians = {name: statistics.median(values) for name, values in throughputs.items()}
    rows = [{"setup": name, "runs": runs, "median_tok_s": medians[name], "vs_pp1": medians[name] / medians["pp1"]}
            for name, runs in throughputs.items()]
    stages = [{"setup": name, "stage": s["stage"], "layers": s["layers"], "busy_ms": s["busy_ms_per_step"],
               "busy": s["busy_share"], "bubble": s["bubble_share"]}
              for name, profile in profiles.items() for s in profile["stages"]]
    return {"rows": rows, "stages": stages}


def table(summary: dict, concurrency: int) -> str:
    lines = [f"| setup | output tok/s at concurrency {concurrency} (median) | runs | vs PP1 |", "|---|---|---|---|"]
    for r in summary["rows"]:
        runs = ", ".join(f"{v:.1f}" for v in r["runs"])
        lines.append(f"| {r['setup'].upper()} | {r['median_tok_s']:.1f} | {runs} | {r['vs_pp1']:.2f}x |")
    if summary["stages"]:
        lines += ["", "| pipeline | stage | layers | busy ms/step | busy | bubble (waiting for input) |",
                  "|---|---|---|---|---|---|"]
        for b in summary["stages"]:
            a, z = b["layers"]
            lines.append(f"| {b['setup'].upper()} | {b['stage']} | {a}-{z - 1} | {b['busy_ms']:.1f} | {b['busy']:.0%} "
                         f"| {b['bubble']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    paths = artifacts(args.base, args.out, args.pp_layers)
    setups = list(paths)
    throughputs: dict[str, list[float]] = {name: [] for name in setups}
    for r, order in enumerate(rotation(setups, args.rounds)):
        for name in order:
            report = args.out / f"{name}-round{r}.json"
            print(f"== round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            subprocess.run(bench_command(paths[name], args.concurrency, args.output_len, report), check=True,
                           stdout=subprocess.DEVNULL)
            throughputs[name].append(json.loads(report.read_text())["output_throughput"])
    profiles = {}
    for name in (n for n in setups if n.startswith("pp2")):
        profile_json = args.out / f"profile-{name}.json"
        print(f"== llmopt profile {name}", file=sys.stderr, flush=True)
        subprocess.run([*LLMOPT, "profile", str(paths[name]), "--batch-sizes", f"1,{args.concurrency}",
                        "--max-num-seqs", str(args.concurrency), "--json", str(profile_json)], check=True,
                       stdout=subprocess.DEVNULL)
        profiles[name] = json.loads(profile_json.read_text())
    summary = summarize(throughputs, profiles)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    text = table(summary, args.concurrency)
    (args.out / "pipeline.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
