"""Quantization quality off the calibration domain, one run (`make quality-domains`, docs/quantize.md):

    python scripts/calib_domains.py BASE [--calib MIX]... [--methods gptq] [--nsamples 128] [--seqlen 2048]
                                         [--windows 32] [--out DIR]

BASE is a float artifact (make's out/bench/base: smollm2-135m in fp32). The script quantizes it to W4A16 g64
(symmetric, lm_head and embeddings kept) with RTN (no calibration) and with each METHOD once per `--calib` value
(the old default `wikitext2-valid`, and each mix given), all with the same --nsamples x --seqlen and seed 0, then
scores the base and every artifact with `llmopt eval --text SET --max-windows W` on each of the evaluation sets
(wikitext2, code, chat: eval/texts.py). For each artifact and set: perplexity, and the share of RTN's perplexity
increase it removes, (RTN - it) / (RTN - base). The worst set's share is the number a default has to maximize.

Writes DIR/<name>/ (the artifacts), DIR/domains.json (every score) and DIR/domains.md (the table), and prints the
table. An artifact already there (its manifest present) is reused, and so is its score at the same --windows
(DIR/<name>/eval-wW.json, DIR/base-eval-wW.json, keyed by the manifest's hash): a run that stopped resumes, and a
run that adds a calibration scores only the new artifacts.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

LLMOPT = [sys.executable, "-m", "llmopt.cli.main"]
SETS = ("wikitext2", "code", "chat")
SCHEME = ["--scheme", "W4A16", "--group-size", "64", "--embeddings", "keep", "--eval-windows", "0"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("--calib", action="append", help="a calibration (a name or a NAME:WEIGHT mix); repeat. "
                        "wikitext2-valid (the old default) always runs first")
    parser.add_argument("--methods", default="gptq")
    parser.add_argument("--nsamples", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("bench-results/domains"))
    args = parser.parse_args(argv)
    args.calib = list(dict.fromkeys(["wikitext2-valid", *(args.calib or [])]))
    args.methods = [m for m in args.methods.split(",") if m]
    if args.nsamples < 1 or args.seqlen < 2 or args.windows < 1 or not args.methods:
        parser.error("--nsamples, --seqlen and --windows take positive numbers; --methods at least one")
    return args


def slug(calib: str) -> str:
    """A folder name for a calibration: wikitext2-valid:0.3,sharegpt:0.5 -> wikitext2-valid-0.3_sharegpt-0.5."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", calib.replace(",", "_").replace(":", "-"))


def runs(args) -> list[tuple[str, list[str]]]:
    """(name, quantize options) of every artifact: RTN first, then each method with each calibration."""
    out = [("rtn", ["--method", "rtn"])]
    for method in args.methods:
        for calib in args.calib:
            out.append((f"{method}-{slug(calib)}", ["--method", method, "--calib", calib, "--nsamples",
                                                      str(args.nsamples), "--seqlen", str(args.seqlen), "--seed", "0"]))
    return out


def removed(base: float, rtn: float, ppl: float) -> float | None:
    """The share of RTN's perplexity increase over the base that `ppl` removes (None when RTN adds none)."""
    return None if rtn <= base else (rtn - ppl) / (rtn - base)


def table(scores: dict[str, dict[str, float]], calibs: dict[str, str], seconds: dict[str, float]) -> str:
    base, rtn = scores["base"], scores["rtn"]
    head = "| artifact | calibration | " + " | ".join(f"{s} ppl | {s} removed" for s in SETS) + \
        " | worst removed | quantize s |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, ppl in scores.items():
        cells = []
        shares = []
        for s in SETS:
            share = removed(base[s], rtn[s], ppl[s]) if name not in ("base", "rtn") else None
            shares.append(share)
            cells += [f"{ppl[s]:.4f}", "" if share is None else f"{share:.0%}"]
        worst = min((x for x in shares if x is not None), default=None)
        lines.append(f"| {name} | {calibs.get(name, '')} | " + " | ".join(cells) +
                     f" | {'' if worst is None else f'{worst:.0%}'} | {seconds.get(name, ''):} |")
    return "\n".join(lines)


def manifest_hash(path: Path) -> str:
    return hashlib.sha256((path / "llmopt.json").read_bytes()).hexdigest()


def cached_perplexities(path: Path, windows: int, cache: Path) -> dict[str, float]:
    """perplexities(path, windows), read from `cache` when it holds them for this very artifact (its manifest's
    hash) and these windows, else measured and written there."""
    key = {"manifest_sha256": manifest_hash(path), "windows": windows, "sets": list(SETS)}
    stored = read_cache(cache)
    if stored is not None and {k: stored.get(k) for k in key} == key:
        return {s: float(stored["perplexity"][s]) for s in SETS}
    scores = perplexities(path, windows)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({**key, "perplexity": scores}, indent=1))
    tmp.replace(cache)
    return scores


def read_cache(cache: Path) -> dict | None:
    """A score file's contents, or None when there is none or it is not one (unreadable, not JSON, no score of
    every set): then the artifact is scored again."""
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and isinstance(data.get("perplexity"), dict) and set(SETS) <= set(data["perplexity"])
    return data if ok else None


def perplexities(path: Path, windows: int) -> dict[str, float]:
    """Every set's perplexity of the artifact at `path`, from one `llmopt eval` (one model load)."""
    done = subprocess.run([*LLMOPT, "eval", str(path), "--text", ",".join(SETS), "--max-windows", str(windows),
                           "--json", "--no-store"], check=True, capture_output=True, text=True)
    return parse_perplexities(done.stdout)


def parse_perplexities(stdout: str) -> dict[str, float]:
    """`llmopt eval --json`'s output (one object per set, keyed by its name) as {set: perplexity}."""
    data = json.loads(stdout)
    missing = [s for s in SETS if s not in data]
    if missing:
        raise SystemExit(f"llmopt eval gave no result for {', '.join(missing)} (does the model have a chat template?)")
    return {s: float(data[s]["perplexity"]) for s in SETS}


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    calibs, seconds, paths = {}, {}, {"base": args.base}
    for name, options in runs(args):
        dest = args.out / name
        calibs[name] = options[options.index("--calib") + 1] if "--calib" in options else "none"
        paths[name] = dest
        if (dest / "llmopt.json").is_file():
            continue
        print(f"== quantize {name}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        subprocess.run([*LLMOPT, "quantize", str(args.base), "-o", str(dest), *options, *SCHEME, "--force"],
                       check=True, stdout=subprocess.DEVNULL)
        seconds[name] = round(time.perf_counter() - start)
    scores: dict[str, dict[str, float]] = {}
    for name, path in paths.items():
        cache = args.out / f"base-eval-w{args.windows}.json" if name == "base" else path / f"eval-w{args.windows}.json"
        print(f"== eval {name}", file=sys.stderr, flush=True)
        scores[name] = cached_perplexities(path, args.windows, cache)
    result = {"nsamples": args.nsamples, "seqlen": args.seqlen, "windows": args.windows, "scores": scores,
              "calibrations": calibs, "quantize_seconds": seconds}
    (args.out / "domains.json").write_text(json.dumps(result, indent=1))
    text = (f"W4A16 g64 sym, {args.nsamples} x {args.seqlen} calibration (seed 0), first {args.windows} windows of "
            f"each set (all a set has where fewer)\n\n" + table(scores, calibs, seconds))
    (args.out / "domains.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
