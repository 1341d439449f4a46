"""GPTQ weights in llama.cpp: `llmopt export --format gguf` against llama.cpp's own Q4_0 (`make bench-gguf-export`).

    python scripts/bench_gguf_export.py [--source smollm2-135m] [--nsamples 128] [--seqlen 2048] [--chunks 32]
                                        [--ctx 2048] [--threads 2] [--out DIR] [--llama-bin DIR]

llama.cpp is built here, in DIR/llama.cpp, from the vendored source of the llama-cpp-python sdist (`pip download
--no-binary`; cmake, only the tools used: llama-quantize, llama-perplexity, llama-bench, llama-imatrix), unless
--llama-bin names a folder that holds them. It never becomes a dependency of llmopt. Then, from one base
(`llmopt import SOURCE`, exported as an F32 GGUF):

- `llama-q4_0`: llama-quantize's Q4_0 of the base (round to nearest), token embedding (tied output) as Q8_0;
- `llama-imatrix-q4_0`: the same with llama.cpp's importance matrix, computed by llama-imatrix on the same
  calibration text (wikitext2-valid) as llmopt's GPTQ; llama.cpp's own calibrated Q4_0;
- `llmopt-rtn-q4_0`: `llmopt quantize --method rtn` W4A16 g32 bf16, exported: shows the re-pack alone;
- `llmopt-gptq-q4_0`: `llmopt quantize --method gptq` W4A16 g32 bf16 (NSAMPLES x SEQLEN wikitext2-valid),
  exported: its Q4_0 blocks are the GPTQ codes bit for bit;
- `llama-q4_0-default`: llama-quantize's Q4_0 with its own defaults, for reference (for SmolLM2 it picks Q8_0 for
  the token embedding itself, so this is the same file as `llama-q4_0`: its speed figures show llama-bench's noise).

The four compared files hold the same types tensor for tensor (Q4_0 linears, Q8_0 token embedding, F32 norms):
llmopt's artifacts keep an int8 g64 embedding, re-quantized to Q8_0 on export (`--allow-requantize q8_0`, which
the export lists). Every file gets `llama-perplexity` on the same WikiText-2 test text and windows (-c CTX,
--chunks CHUNKS) and `llama-bench` (prompt 512, generate 128, THREADS threads), in rounds that interleave the
files. Writes DIR/table.md and DIR/table.json and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

LLMOPT = [sys.executable, "-m", "llmopt.cli.main"]
TOOLS = ("llama-quantize", "llama-perplexity", "llama-bench", "llama-imatrix")
SDIST = "llama-cpp-python==0.3.36"  # the llama.cpp the published table was measured with
# llama.cpp repacks Q4_0 weights for AMX where the CPU reports it; in this VM the tile instructions then crash
# (SIGILL or SIGSEGV at tileloadd), so the runs keep weights as stored (the Makefile's LLAMA_ARGS says the same).
NO_REPACK = ["--no-repack"]


def log(text: str) -> None:
    print(f"== {text}", file=sys.stderr, flush=True)


def run(command: list, out: Path | None = None, **kw) -> subprocess.CompletedProcess:
    """Run to its end (output to `out` when given); a failure stops the benchmark with the log's tail."""
    command = [str(c) for c in command]
    if out is None:
        result = subprocess.run(command, capture_output=True, text=True, **kw)
        text = result.stdout + result.stderr
    else:
        with open(out, "w") as handle:
            result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, text=True, **kw)
        text = out.read_text(errors="replace")
    if result.returncode != 0:
        tail = "\n".join(text.splitlines()[-20:])
        raise SystemExit(f"`{' '.join(command[:4])} ...` exited {result.returncode}:\n{tail}")
    result.text = text
    return result


def build_llama(out: Path, jobs: int) -> Path:
    """llama.cpp's tools built from the llama-cpp-python sdist's vendored source, in `out`; their folder."""
    source, build = out / "llama.cpp", out / "llama.cpp" / "build"
    bin_dir = build / "bin"
    if all((bin_dir / tool).exists() for tool in TOOLS):
        return bin_dir
    if not (source / "CMakeLists.txt").exists():
        log(f"downloading the {SDIST} sdist")
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", out])
        sdist = out / f"llama_cpp_python-{SDIST.split('==')[1]}.tar.gz"
        with tarfile.open(sdist) as tar:
            top = tar.getnames()[0].split("/")[0]
            members = [m for m in tar.getmembers() if m.name.startswith(f"{top}/vendor/llama.cpp/")]
            tar.extractall(out / "sdist", members=members, filter="data")
        shutil.move(str(out / "sdist" / top / "vendor" / "llama.cpp"), source)
        shutil.rmtree(out / "sdist")
    log(f"building llama.cpp in {build} ({', '.join(TOOLS)})")
    start = time.monotonic()
    run(["cmake", "-S", source, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
         "-DGGML_NATIVE=ON"], out / "cmake-configure.log")
    run(["cmake", "--build", build, "-j", str(jobs), "--target", *TOOLS], out / "cmake-build.log")
    log(f"built in {time.monotonic() - start:.0f} s")
    return bin_dir


def llmopt_q4_0(base: Path, out: Path, method: str, args: argparse.Namespace) -> tuple[Path, float]:
    """`llmopt quantize` W4A16 g32 bf16 (int8 embedding) then `llmopt export --format gguf`: the file and the
    quantization's wall seconds."""
    artifact, gguf_file = out / f"llmopt-{method}-g32", out / f"llmopt-{method}-q4_0.gguf"
    calib = ["--nsamples", args.nsamples, "--seqlen", args.seqlen, "--seed", args.seed] if method != "rtn" else []
    start = time.monotonic()
    run([*LLMOPT, "quantize", base, "-o", artifact, "--method", method, "--scheme", "W4A16", "--group-size", "32",
         "--dtype", "bf16", "--embeddings", "int8", *calib, "--eval-windows", "0", "--force"],
        out / f"llmopt-{method}.log")
    seconds = time.monotonic() - start
    run([*LLMOPT, "export", artifact, "--format", "gguf", "-o", gguf_file, "--allow-requantize", "q8_0", "--force"],
        out / f"llmopt-{method}-export.log")
    return gguf_file, seconds


def tensor_types(path: Path) -> str:
    """The file's tensor types with counts, e.g. `Q4_0 x210, Q8_0 x1, F32 x61`."""
    import gguf

    counts: dict[str, int] = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return ", ".join(f"{name} x{n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def perplexity(bin_dir: Path, model: Path, text: Path, args: argparse.Namespace, log_path: Path) -> float:
    """llama-perplexity's final estimate on `text`: CHUNKS windows of CTX tokens (each window's second half
    scored, llama.cpp's protocol)."""
    result = run([bin_dir / "llama-perplexity", "-m", model, "-f", text, "-c", args.ctx, "-b", args.ctx,
                  "--chunks", args.chunks, "-t", args.threads, *NO_REPACK], log_path)
    value = final_estimate(result.text)
    if value is None:
        raise SystemExit(f"llama-perplexity printed no final estimate; see {log_path}")
    return value


def final_estimate(text: str) -> float | None:
    """The perplexity in llama-perplexity's `Final estimate: PPL = 12.3456 +/- 0.12345` line."""
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", text)
    return float(found.group(1)) if found else None


def bench_medians(rounds: list[list[dict]], by_file: dict[str, str]) -> dict[str, dict[str, float]]:
    """Median tokens/s per file and test (pp512: records with a prompt, tg128: generation) over llama-bench's
    JSON records of every round; `by_file` maps model_filename to the row name."""
    samples: dict[str, dict[str, list[float]]] = {}
    for records in rounds:
        for rec in records:
            test = f"pp{rec['n_prompt']}" if rec["n_prompt"] else f"tg{rec['n_gen']}"
            samples.setdefault(by_file[rec["model_filename"]], {}).setdefault(test, []).append(float(rec["avg_ts"]))
    return {name: {test: statistics.median(v) for test, v in tests.items()} for name, tests in samples.items()}


def speed(bin_dir: Path, models: dict[str, Path], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """llama-bench over every file in ROUNDS rounds, the order rotated each round: median prompt (pp512) and
    generation (tg128) tokens/s per file."""
    names, rounds = list(models), []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        command = [bin_dir / "llama-bench", *[x for n in order for x in ("-m", models[n])], "-p", "512", "-n", "128",
                   "-t", args.threads, "-r", "2", "--repack", "0", "-o", "json"]
        rounds.append(json.loads(run(command).stdout))
    return bench_medians(rounds, {str(models[n]): n for n in names})


ROWS = {  # name -> what the file is
    "llama-q4_0": "llama-quantize Q4_0 (round to nearest), token embedding Q8_0",
    "llama-imatrix-q4_0": "llama-quantize Q4_0 with llama-imatrix on wikitext2-valid, token embedding Q8_0",
    "llmopt-rtn-q4_0": "llmopt quantize rtn W4A16 g32, exported",
    "llmopt-gptq-q4_0": "llmopt quantize gptq W4A16 g32, exported",
    "llama-q4_0-default": "llama-quantize Q4_0 with its own defaults (the same file as llama-q4_0 for SmolLM2)",
}


def table(results: dict, args: argparse.Namespace, base_ppl: float) -> str:
    ref = results["llama-q4_0"]
    lines = [f"{args.source}; llama-perplexity on WikiText-2 test, {args.chunks} windows of {args.ctx} tokens "
             f"(F32 base {base_ppl:.4f}); llama-bench pp512 / tg128 with {args.threads} threads, medians of "
             f"{args.rounds} rounds; calibration {args.nsamples} x {args.seqlen} wikitext2-valid; quantize s: the "
             f"quantization's wall seconds (llama-imatrix's run, or llmopt quantize).", "",
             "| file | what | types | MiB | quantize s | perplexity | vs llama Q4_0 | pp512 tok/s | tg128 tok/s | "
             "tg vs llama Q4_0 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        seconds = f"{r['seconds']:.0f}" if "seconds" in r else ""
        lines.append(f"| {name} | {ROWS[name]} | {r['types']} | {r['mib']:.1f} | {seconds} | {r['ppl']:.4f} | "
                     f"{r['ppl'] / ref['ppl']:.3f}x | {r['pp512']:.0f} | {r['tg128']:.1f} | "
                     f"{r['tg128'] / ref['tg128']:.3f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", default="smollm2-135m")
    parser.add_argument("--nsamples", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunks", type=int, default=32, help="llama-perplexity windows")
    parser.add_argument("--ctx", type=int, default=2048, help="llama-perplexity window length")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--rounds", type=int, default=3, help="llama-bench rounds over all files")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="cmake build jobs")
    parser.add_argument("--llama-bin", type=Path, default=None, help="a folder holding the llama.cpp tools")
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench-results/gguf-export"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from llmopt.stages.data import resolve_text  # the shared data, as llmopt eval finds it ($LLMOPT_DATA_DIR)

    calib_text, test_text = resolve_text("wikitext2-valid"), resolve_text("wikitext2")
    bin_dir = args.llama_bin or build_llama(args.out, args.jobs)
    if args.build_only:
        return 0
    for tool in TOOLS:
        if not (bin_dir / tool).exists():
            raise SystemExit(f"{bin_dir} has no {tool}")
    out = args.out
    base = out / "base"
    if not (base / "llmopt.json").exists():
        log(f"llmopt import {args.source}")
        run([*LLMOPT, "import", args.source, "-o", base, "--dtype", "fp32", "--force"])
    base_gguf = out / "base-f32.gguf"
    if not base_gguf.exists():
        run([*LLMOPT, "export", base, "--format", "gguf", "-o", base_gguf, "--force"])
    files: dict[str, Path] = {}
    seconds: dict[str, float] = {}
    q = [bin_dir / "llama-quantize", "--token-embedding-type", "q8_0", "--output-tensor-type", "q8_0"]
    log("llama-quantize Q4_0")
    files["llama-q4_0"] = out / "llama-q4_0.gguf"
    run([*q, base_gguf, files["llama-q4_0"], "Q4_0", args.threads], out / "llama-quantize.log")
    log(f"llama-imatrix on wikitext2-valid, {args.nsamples} x {args.seqlen}")
    imatrix = out / "imatrix.gguf"
    start = time.monotonic()
    run([bin_dir / "llama-imatrix", "-m", base_gguf, "-f", calib_text, "-c", args.seqlen, "-b",
         args.seqlen, "--chunks", args.nsamples, "-t", args.threads, "--no-ppl", *NO_REPACK, "-o", imatrix],
        out / "llama-imatrix.log")
    seconds["llama-imatrix-q4_0"] = time.monotonic() - start
    files["llama-imatrix-q4_0"] = out / "llama-imatrix-q4_0.gguf"
    run([*q, "--imatrix", imatrix, base_gguf, files["llama-imatrix-q4_0"], "Q4_0", args.threads],
        out / "llama-quantize-imatrix.log")
    for method in ("rtn", "gptq"):
        log(f"llmopt quantize {method} W4A16 g32 and export")
        files[f"llmopt-{method}-q4_0"], seconds[f"llmopt-{method}-q4_0"] = llmopt_q4_0(base, out, method, args)
    files["llama-q4_0-default"] = out / "llama-q4_0-default.gguf"
    run([bin_dir / "llama-quantize", base_gguf, files["llama-q4_0-default"], "Q4_0", args.threads],
        out / "llama-quantize-default.log")
    log("llama-perplexity on the F32 base")
    base_ppl = perplexity(bin_dir, base_gguf, test_text, args, out / "perplexity-base.log")
    results: dict[str, dict] = {}
    for name, path in files.items():
        log(f"llama-perplexity on {name}")
        results[name] = {"file": str(path), "types": tensor_types(path), "mib": path.stat().st_size / 2**20,
                         "ppl": perplexity(bin_dir, path, test_text, args, out / f"perplexity-{name}.log"),
                         **({"seconds": seconds[name]} if name in seconds else {})}
    log(f"llama-bench, {args.rounds} rounds")
    for name, tests in speed(bin_dir, files, args).items():
        results[name].update(tests)
    report = table(results, args, base_ppl)
    (out / "table.json").write_text(json.dumps({"base_ppl": base_ppl, "results": results, "args": vars(args)},
                                               indent=1, default=str))
    (out / "table.md").write_text(report + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
