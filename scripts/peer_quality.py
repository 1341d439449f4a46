"""llmopt's GPTQ and AWQ against llm-compressor's at equal settings, side by side (`make peer-quality`).

    python scripts/peer_quality.py [--source smollm2-135m] [--methods gptq,awq] [--nsamples 128] [--seqlen 2048]
                                   [--awq-calib NxL] [--windows 32] [--no-rtn] [--peer-venv .peer-venv] [--out DIR]

Both tools quantize the same base (`llmopt import SOURCE`, a Hugging Face folder) with the same calibration rows:
llmopt's own `calibration_windows` (wikitext2-valid, NSAMPLES x SEQLEN, seed 0) are written to DIR/calib.pt and
llm-compressor's `oneshot` gets exactly those token ids. Scheme W4A16, groups of 64, symmetric, lm_head and the
embeddings kept (on CPU, llm-compressor's AWQ needs one patch: its cache's pin_memory becomes a no-op, see
PEER_RUNNER). llm-compressor runs in its own virtualenv (`--peer-venv`, made here on first use with the same
pinned CPU torch, then `llmcompressor==PEER_VERSION`): it never becomes a dependency of llmopt. Each quantization
is a process of its own; its wall time, CPU time and peak RSS (the kernel's, from wait4) are recorded. Every
artifact, both tools', is then scored by `llmopt eval` on the same WikiText-2 test windows, with mean KL to the
base, and against llmopt's RTN at the same scheme (no calibration): the share of RTN's increase each method removes.
`--awq-calib` gives AWQ a calibration size of its own (llm-compressor's AWQ scores 20 grid points by running each
layer's modules over every calibration token, which at 128 x 2048 takes hours on 2 cores).

Writes DIR/<tool>-<method>/ (the artifacts), DIR/<tool>-<method>.log, DIR/peer.json and DIR/peer.md (the table),
and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PEER_VERSION = "0.14.0.1"
TORCH_VERSION = "2.13.0"
LLMOPT = [sys.executable, "-m", "llmopt.cli.main"]

PEER_RUNNER = '''
"""Run in the peer virtualenv: llm-compressor's oneshot on the given rows, saved compressed."""
import json, sys
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot

base, calib, out, method, group = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
rows = torch.load(calib)
data = Dataset.from_dict({"input_ids": rows.tolist(), "attention_mask": torch.ones_like(rows).tolist()})
weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
if method == "gptq":
    from llmcompressor.modifiers.quantization import GPTQModifier
    recipe = GPTQModifier(config_groups=groups, ignore=["lm_head"], dampening_frac=0.01)
else:
    from llmcompressor.modifiers.awq import AWQModifier
    recipe = AWQModifier(config_groups=groups, ignore=["lm_head"])
    if not torch.cuda.is_available():
        # AWQ pins its cached activations for faster host-to-device copies during its grid search
        # (modifiers/transform/awq/base.py, pipelines/cache.py: value.pin_memory()); without an accelerator torch
        # 2.13 refuses ("Cannot access accelerator device when none is available"). Pinning changes no number:
        # on CPU the cache stays as it is.
        from llmcompressor.pipelines.cache import IntermediatesCache
        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(base)
oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=rows.shape[1], num_calibration_samples=rows.shape[0])
model.save_pretrained(out, save_compressed=True)
tokenizer.save_pretrained(out)
print(json.dumps({"peer": "llmcompressor", "method": method}))
'''


def peer_python(venv: Path) -> Path:
    """The peer virtualenv's python, made on first use: pinned CPU torch first, then llm-compressor."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"== making {venv} (torch=={TORCH_VERSION}, llmcompressor=={PEER_VERSION})", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}"], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"llmcompressor=={PEER_VERSION}"], check=True)
    return python


def timed(command: list[str], log: Path) -> dict:
    """Run `command` to its end: wall seconds, CPU seconds (user + system, which another process on the machine
    moves less than wall time) and peak RSS (MiB) of that process alone (wait4's rusage)."""
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.monotonic() - start
    cpu = usage.ru_utime + usage.ru_stime
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise SystemExit(f"`{' '.join(command[:6])} ...` exited {code}:\n{tail}")
    return {"seconds": seconds, "cpu_seconds": cpu, "peak_rss_mib": usage.ru_maxrss / 1024}


def write_calibration(base: Path, nsamples: int, seqlen: int, seed: int, path: Path) -> None:
    """llmopt's own calibration rows for `base`, saved for the peer to read."""
    import torch

    from llmopt.stages.calib import CalibConfig, calibration_windows
    from llmopt.stages.model_io import load_tokenizer

    rows = calibration_windows(load_tokenizer(base), CalibConfig("wikitext2-valid", nsamples, seqlen, seed))
    torch.save(rows, path)


def evaluate(artifact: Path, base: Path | None, windows: int) -> dict:
    """`llmopt eval` of any artifact (llm-compressor's output is a compressed-tensors folder it reads), fp32, with
    mean KL to `base` when given."""
    ref = ["--ref", str(base)] if base is not None else []
    result = subprocess.run([*LLMOPT, "eval", str(artifact), "--max-windows", str(windows), *ref, "--dtype", "fp32",
                             "--no-store", "--json"], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"llmopt eval {artifact} exited {result.returncode}: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout)["wikitext2"]  # {text: result}


def table(rows: list[dict], base_ppl: float, windows: int) -> str:
    rtn = next((r["ppl"] for r in rows if r["method"] == "rtn"), None)
    lines = [f"W4A16, groups of 64, symmetric, lm_head and embeddings kept; calibration wikitext2-valid, N x L as "
             f"given (the same rows for both tools); perplexity on {windows} WikiText-2 test windows "
             f"(base {base_ppl:.4f}); KL: mean KL divergence to the base; time: wall (CPU) seconds of the "
             f"quantizing process; removed: the share of RTN's perplexity increase a method removes.", "",
             "| method | calibration | tool | perplexity | increase over base | removed | KL | quantize time s | "
             "peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        size = f"{r['nsamples']} x {r['seqlen']}" if r.get("nsamples") else "none"
        removed = (f"{100 * (rtn - r['ppl']) / (rtn - base_ppl):.0f}%"
                   if rtn is not None and r["method"] != "rtn" and rtn > base_ppl else "")
        lines.append(f"| {r['method']} | {size} | {r['tool']} | {r['ppl']:.4f} | "
                     f"{100 * (r['ppl'] / base_ppl - 1):+.1f}% | {removed} | {r['kl']:.4f} | {r['seconds']:.0f} "
                     f"({r['cpu_seconds']:.0f}) | {r['peak_rss_mib']:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", default="smollm2-135m")
    parser.add_argument("--methods", default="gptq,awq")
    parser.add_argument("--nsamples", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--awq-calib", default=None, metavar="NxL",
                        help="AWQ's calibration size when it differs from --nsamples x --seqlen (llm-compressor's "
                             "AWQ runs each layer's modules 20 times over every calibration token)")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--no-rtn", dest="rtn", action="store_false",
                        help="skip the RTN row (llmopt, no calibration) that the methods' gains are measured from")
    parser.add_argument("--peer-venv", type=Path, default=Path(".peer-venv"))
    parser.add_argument("--out", type=Path, default=Path("bench-results/peer-quality"))
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",")]
    if not methods or set(methods) - {"gptq", "awq"}:
        parser.error("--methods: gptq, awq or both, comma-separated")
    sizes = {method: (args.nsamples, args.seqlen) for method in methods}
    if args.awq_calib:
        try:
            n, length = (int(part) for part in args.awq_calib.lower().split("x"))
        except ValueError:
            n = length = 0
        if n < 1 or length < 1:
            parser.error(f"--awq-calib: expected NxL of positive integers, e.g. 32x512, got {args.awq_calib!r}")
        sizes["awq"] = (n, length)
    args.out.mkdir(parents=True, exist_ok=True)
    python = peer_python(args.peer_venv)
    base = args.out / "base"
    if not (base / "llmopt.json").exists():
        subprocess.run([*LLMOPT, "import", args.source, "-o", str(base), "--force"], check=True)
    runner = args.out / "peer_runner.py"
    runner.write_text(PEER_RUNNER)
    rows = []
    if args.rtn:
        dest = args.out / "llmopt-rtn"
        print("== llmopt rtn", file=sys.stderr, flush=True)
        cost = timed([*LLMOPT, "quantize", str(base), "-o", str(dest), "--method", "rtn", "--scheme", "W4A16",
                      "--group-size", str(args.group_size), "--embeddings", "keep", "--eval-windows", "0", "--force"],
                     args.out / "llmopt-rtn.log")
        scored = evaluate(dest, base, args.windows)
        rows.append({"method": "rtn", "tool": "llmopt", "ppl": scored["perplexity"], "kl": scored.get("kl_mean"),
                     **cost})
    for method in methods:
        nsamples, seqlen = sizes[method]
        calib = args.out / f"calib-{nsamples}x{seqlen}-{args.seed}.pt"
        if not calib.exists():
            write_calibration(base, nsamples, seqlen, args.seed, calib)
        for tool in ("llmopt", "llmcompressor"):
            dest = args.out / f"{tool}-{method}"
            print(f"== {tool} {method}", file=sys.stderr, flush=True)
            if tool == "llmopt":
                command = [*LLMOPT, "quantize", str(base), "-o", str(dest), "--method", method, "--scheme", "W4A16",
                           "--group-size", str(args.group_size), "--calib", "wikitext2-valid", "--nsamples",
                           str(nsamples), "--seqlen", str(seqlen), "--seed", str(args.seed),
                           "--embeddings", "keep", "--eval-windows", "0", "--force"]
            else:
                command = [str(python), str(runner), str(base), str(calib), str(dest), method, str(args.group_size)]
            cost = timed(command, args.out / f"{tool}-{method}.log")
            scored = evaluate(dest, base, args.windows)
            rows.append({"method": method, "tool": tool, "nsamples": nsamples, "seqlen": seqlen,
                         "ppl": scored["perplexity"], "kl": scored.get("kl_mean"), **cost})
            print(f"   ppl {scored['perplexity']:.4f}, {cost['seconds']:.0f} s, {cost['peak_rss_mib']:,.0f} MiB",
                  file=sys.stderr, flush=True)
    base_ppl = evaluate(base, None, args.windows)["perplexity"]
    text = table(rows, base_ppl, args.windows)
    (args.out / "peer.json").write_text(json.dumps({"base_ppl": base_ppl, "rows": rows, "args": vars(args)},
                                                   indent=1, default=str))
    (args.out / "peer.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
