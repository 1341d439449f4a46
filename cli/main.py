"""The `llmopt` command: wires the subcommands and turns user errors into one line and exit 2."""
from __future__ import annotations

import signal
import sys
import threading

from llmopt.kernels.threads import choose_wait_policy

choose_wait_policy()  # libgomp reads its wait policy once, when torch loads it: before any command can import torch

import typer
from typer.exceptions import TyperException

from llmopt.stages.errors import LlmoptError

from . import (bench_cmd, bench_compare_cmd, bench_summary_cmd, eval_cmd, generate_cmd, import_cmd, inspect_cmd,
               profile_cmd, prune_cmd, quantize_cmd, run_cmd, serve_cmd, shard_cmd)

app = typer.Typer(
    name="llmopt", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="Compress-then-serve toolchain for causal language models.",
)
app.command("run", help="Run a recipe (YAML pipeline): stages in order, finished ones skipped, one comparison table.")(run_cmd.run)
app.command("import", help="Write a base artifact from any model source.")(import_cmd.run)
app.command("inspect", help="Show an artifact's manifest, lineage, sizes and metrics.")(inspect_cmd.run)
app.command("quantize", help="Quantize (RTN, GPTQ, AWQ, SmoothQuant, bitsandbytes) into a compressed-tensors artifact.")(quantize_cmd.run)
app.command("prune", help="Prune (magnitude, Wanda, SparseGPT; unstructured, N:M) or shrink (MLP channels, layers).")(prune_cmd.run)
app.command("shard", help="Split a model for tensor-parallel serving (--tp N): one folder per rank plus the plan.")(shard_cmd.run)
app.command("eval", help="Perplexity (and KL vs a reference) on a text, GPTQ-style windows.")(eval_cmd.run)
app.command("generate", help="Offline generation through the serve engine (one prompt, or a resumable JSONL batch).")(generate_cmd.run)
app.command("profile", help="Where time and memory go on the serve engine: roofline, per-layer/op, capacity plan, HTML.")(profile_cmd.run)
app.command("serve", help="OpenAI-compatible HTTP server: streaming, metrics, health, backpressure, auth.")(serve_cmd.run)
bench = typer.Typer(invoke_without_command=True, add_completion=False, help=(
    "Load-test an OpenAI-compatible server: throughput, TTFT, TPOT, ITL and end-to-end latency; or, with --offline, "
    "the engine in this process against transformers."))
bench.callback()(bench_cmd.run)
bench.command("compare", help="Side-by-side table of two --json reports; exit 1 on a regression beyond the bound.")(
    bench_compare_cmd.run)
bench.command("summary", help="One Markdown table of a folder of NAME-cC.json reports (make bench), ratios to a baseline.")(
    bench_summary_cmd.run)
app.add_typer(bench, name="bench", help="Load-test an OpenAI-compatible server (or the engine offline); `bench compare` "
              "gates regressions.")


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors.")) -> None:
    """llmopt: prune, quantize, shard, profile, serve and bench causal LMs."""


def _fail(message: str, code: int) -> int:
    from rich.console import Console

    # A fresh console: an interrupt can land while the shared one is mid-render and buffering.
    Console(stderr=True).print(f"[bold red]error:[/bold red] {message}", highlight=False, soft_wrap=True)
    return code


def _terminate(signum, frame) -> None:
    # SIGTERM (kill, a CI timeout) unwinds like Ctrl-C, so stages remove their temporary output.
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    debug = "--debug" in argv
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="llmopt", standalone_mode=False)
        if result == 130:  # typer's click turns Ctrl-C / SIGTERM into a silent exit code 130
            return _fail("interrupted", 130)
        return result if isinstance(result, int) else 0
    except TyperException as e:  # typer's own click: usage errors and aborts
        if type(e).__name__ == "Abort":
            return _fail("interrupted", 130)
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        return _fail(" ".join(message.split()), 2)
    except LlmoptError as e:
        if debug:
            raise
        return _fail(str(e), 2)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except Exception as e:  # a bug, not bad input: say so, keep the traceback behind --debug
        if debug:
            raise
        return _fail(f"internal error: {e.__class__.__name__}: {e} (rerun with --debug for the traceback)", 1)


if __name__ == "__main__":
    sys.exit(main())
