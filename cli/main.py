"""The `llmopt` command: wires the subcommands and turns user errors into one line and exit 2.

A process imports only the command module it runs (`llmopt serve` never loads the bench's); help, no
command or an unknown one build every command, so they read exactly as the full app does."""
from __future__ import annotations

import importlib
import signal
import sys
import threading

from llmopt.kernels.threads import choose_wait_policy

choose_wait_policy()  # libgomp reads its wait policy once, when torch loads it: before any command can import torch

import typer
from typer.exceptions import TyperException

from llmopt.stages.errors import LlmoptError

# (name, module in llmopt.cli whose `run` is the command, help), in the order help lists them
COMMANDS = (
    ("run", "run_cmd", "Run a recipe (YAML pipeline): stages in order, finished ones skipped, one comparison table."),
    ("import", "import_cmd", "Write a base artifact from any model source."),
    ("inspect", "inspect_cmd", "Show an artifact's manifest, lineage, sizes and metrics."),
    ("quantize", "quantize_cmd", "Quantize (RTN, GPTQ, AWQ, SmoothQuant, bitsandbytes) into a compressed-tensors artifact."),
    ("prune", "prune_cmd", "Prune (magnitude, Wanda, SparseGPT; unstructured, N:M) or shrink (MLP channels, layers)."),
    ("shard", "shard_cmd", "Split a model for tensor-parallel serving (--tp N): one folder per rank plus the plan."),
    ("eval", "eval_cmd", "Perplexity (and KL vs a reference) on a text, GPTQ-style windows."),
    ("generate", "generate_cmd", "Offline generation through the serve engine (one prompt, or a resumable JSONL batch)."),
    ("profile", "profile_cmd", "Where time and memory go on the serve engine: roofline, per-layer/op, capacity plan, HTML."),
    ("serve", "serve_cmd", "OpenAI-compatible HTTP server: streaming, metrics, health, backpressure, auth."),
)
BENCH_COMMANDS = (
    ("compare", "bench_compare_cmd", "Side-by-side table of two --json reports; exit 1 on a regression beyond the bound."),
    ("summary", "bench_summary_cmd", "One Markdown table of a folder of NAME-cC.json reports (make bench), ratios to a baseline."),
)
BENCH_HELP = ("Load-test an OpenAI-compatible server: throughput, TTFT, TPOT, ITL and end-to-end latency; or, with "
              "--offline, the engine in this process against transformers.")
BENCH_SHORT_HELP = "Load-test an OpenAI-compatible server (or the engine offline); `bench compare` gates regressions."
ROOT_OPTIONS = ("--debug",)  # the root's options that take no value: what may stand before the command's name


def _run(module: str):
    return importlib.import_module(f"{__package__}.{module}").run


def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors.")) -> None:
    """llmopt: prune, quantize, shard, profile, serve and bench causal LMs."""


def _bench_subcommand_only() -> None:
    """`llmopt bench compare|summary`: bench's own callback would return at once, its options all default."""


def build_app(argv: list[str] | None = None) -> typer.Typer:
    """The `llmopt` app with the one command argv names (and, for `bench NAME`, that subcommand only);
    every command when argv is None or names none (help, no command, an unknown one)."""
    name, rest = _command_in(argv)
    app = typer.Typer(name="llmopt", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                      help="Compress-then-serve toolchain for causal language models.")
    app.callback()(_root)
    for command, module, text in COMMANDS:
        if name in (None, command):
            app.command(command, help=text)(_run(module))
    if name in (None, "bench"):
        app.add_typer(_bench(rest if name else None), name="bench", help=BENCH_SHORT_HELP)
    return app


def _bench(argv: list[str] | None) -> typer.Typer:
    sub = argv[0] if argv else None
    only = sub if sub in {command for command, _, _ in BENCH_COMMANDS} else None
    bench = typer.Typer(invoke_without_command=True, add_completion=False, help=BENCH_HELP)
    bench.callback()(_bench_subcommand_only if only else _run("bench_cmd"))
    for command, module, text in BENCH_COMMANDS:
        if only in (None, command):
            bench.command(command, help=text)(_run(module))
    return bench


def _command_in(argv: list[str] | None) -> tuple[str | None, list[str]]:
    """The command argv runs and the arguments after it; None when it runs none of ours (or only asks for help)."""
    known = {command for command, _, _ in COMMANDS} | {"bench"}
    for i, arg in enumerate(argv or ()):
        if arg not in ROOT_OPTIONS:
            return (arg, argv[i + 1:]) if arg in known else (None, [])
    return None, []


def __getattr__(name: str):
    if name == "app":  # every command, for `typer.main.get_command(app)` (tests, docs); built on first use
        globals()["app"] = app = build_app()
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    try:  # the command's module imports here: a Ctrl-C in it is one more interrupt
        command = typer.main.get_command(build_app(argv))
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
