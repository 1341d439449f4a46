"""The `llmopt` command: wires the subcommands and turns user errors into one line and exit 2.

A process imports only the command module it runs (`llmopt serve` never loads the bench's); help, no
command or an unknown one build every command, so they read exactly as the full app does."""
from __future__ import annotations

import importlib
import os
import select
import signal
import sys
import threading
from importlib.metadata import PackageNotFoundError, version

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
    ("export", "export_cmd", "Write an artifact as a GGUF file for llama.cpp (Q4_0 / Q8_0 re-packed bit for bit)."),
    ("eval", "eval_cmd", "Perplexity (and KL vs a reference) on a text, GPTQ-style windows."),
    ("generate", "generate_cmd", "Offline generation through the serve engine (one prompt, or a resumable JSONL batch)."),
    ("profile", "profile_cmd", "Where time and memory go on the serve engine: roofline, per-layer/op, capacity plan, HTML."),
    ("serve", "serve_cmd", "OpenAI-compatible HTTP server: streaming, metrics, health, backpressure, auth."),
    ("route", "route_cmd", "One endpoint in front of serve replicas: round-robin, least-load or cache-aware, health ejection, retries."),
)
BENCH_COMMANDS = (
    ("compare", "bench_compare_cmd", "Side-by-side table of two --json reports; exit 1 on a regression beyond the bound or a NEW/BASE ratio outside --min-ratio/--max-ratio."),
    ("summary", "bench_summary_cmd", "One Markdown table of a folder of NAME-cC.json reports (make bench), ratios to a baseline."),
)
BENCH_HELP = ("Load-test an OpenAI-compatible server: throughput, TTFT, TPOT, ITL and end-to-end latency; or, with "
              "--offline, the engine in this process against transformers.")
BENCH_SHORT_HELP = "Load-test an OpenAI-compatible server (or the engine offline); `bench compare` gates regressions."
ROOT_OPTIONS = ("--debug",)  # the root's options that take no value: what may stand before the command's name
# The environment variables llmopt reads, listed by `llmopt --help` (tests/cli check that none is missing).
ENVIRONMENT = (
    ("LLMOPT_CACHE_DIR", "Caches: imported models, verified hashes, built CPU kernels (default ~/.cache/llmopt)."),
    ("LLMOPT_DATA_DIR", "Folder of the built-in data sets for --calib and eval (default ../shared/data)."),
    ("LLMOPT_API_KEY", "Bearer token that serve requires and bench sends (as --api-key)."),
    ("LLAMA_SERVER", "The llama-server binary for bench --engine llama-server (default: the one on PATH)."),
    ("LLMOPT_TEST_SLOW_STEP", "Test hook, off unless set: each engine step sleeps (N - 1) times its own time (docs/ci.md)."),
)
HELP_WIDTH = 120  # columns of --help when stdout is not a terminal and neither COLUMNS nor TERMINAL_WIDTH says


def _epilog() -> str:
    # typer's rich help keeps lines that start with a backspace paragraph as they are
    lines = "\n".join(f"  {name:<17} {text}" for name, text in ENVIRONMENT)
    return f"\b\nEnvironment:\n{lines}"


def _version() -> str:
    try:
        return version("llmopt")
    except PackageNotFoundError:  # run from a checkout that pip never installed
        return "unknown (not installed)"


def _print_version(value: bool) -> None:
    if value:
        print(f"llmopt {_version()}")
        raise typer.Exit()


def _run(module: str):
    return importlib.import_module(f"{__package__}.{module}").run


def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
          _: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True, expose_value=False,
                                 help="Print the version and exit.")) -> None:
    """llmopt: prune, quantize, shard, profile, serve and bench causal LMs."""


def _bench_subcommand_only() -> None:
    """`llmopt bench compare|summary`: bench's own callback would return at once, its options all default."""


def build_app(argv: list[str] | None = None) -> typer.Typer:
    """The `llmopt` app with the one command argv names (and, for `bench NAME`, that subcommand only);
    every command when argv is None or names none (help, no command, an unknown one)."""
    name, rest = _command_in(argv)
    app = typer.Typer(name="llmopt", no_args_is_help=True, pretty_exceptions_enable=False, epilog=_epilog(),
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


def _plain_flags(command) -> None:
    """No `<bool>` placeholder beside a flag in --help (typer shows one; flags take no value)."""
    for param in [*command.params, command.get_help_option(typer.Context(command))]:
        if param is not None and getattr(param, "is_flag", False):
            param.metavar = ""
    for sub in getattr(command, "commands", {}).values():
        _plain_flags(sub)


def _help_width() -> None:
    """Piped help (`llmopt serve --help | less`) is as wide as HELP_WIDTH, not rich's 80 columns that cut text."""
    if not sys.stdout.isatty() and not (os.environ.get("COLUMNS") or os.environ.get("TERMINAL_WIDTH")):
        from typer import rich_utils

        rich_utils.MAX_WIDTH = HELP_WIDTH


def _reader_left() -> bool:
    """Whether stdout is a pipe whose reader has exited (`llmopt bench --help | head -3`), not some other
    broken pipe (a socket the command writes to)."""
    if not hasattr(select, "poll"):
        return True
    poll = select.poll()
    try:
        poll.register(sys.stdout.fileno(), 0)
    except (AttributeError, OSError, ValueError):  # stdout replaced or closed
        return True
    return any(events & select.POLLERR for _, events in poll.poll(0))


def _closed_pipe_exit(e: SystemExit) -> bool:
    """Whether this exit is rich's or click's answer to a reader that left stdout's pipe."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None and tb.tb_frame.f_code.co_name == "on_broken_pipe":  # rich's Console, stdout already on /dev/null
        return True
    return type(sys.stdout).__name__ == "PacifyFlushWrapper" and _reader_left()


def _quiet_after_pipe() -> int:
    # Like cat or ls: the reader has all it wanted. Stdout goes to /dev/null so the exit's flush is silent.
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # stdout replaced by one without a descriptor
        pass
    finally:
        os.close(devnull)
    return 0


def _invoke(argv: list[str]) -> int:
    if not argv or "--help" in argv:
        _help_width()
    command = typer.main.get_command(build_app(argv))
    _plain_flags(command)
    try:
        result = command.main(args=argv or ["--help"], prog_name="llmopt", standalone_mode=False)
    except SystemExit as e:  # rich and typer's click exit 1 when a write meets a closed pipe
        if e.code == 1 and _closed_pipe_exit(e):
            return _quiet_after_pipe()
        raise
    if result == 130:  # typer's click turns Ctrl-C / SIGTERM into a silent exit code 130
        return _fail("interrupted", 130)
    sys.stdout.flush()  # buffered output meets a closed pipe here, not at the interpreter's exit
    return result if isinstance(result, int) else 0


def main(argv: list[str] | None = None) -> int:
    """`llmopt ARGV`; `llmopt` alone prints the help and exits 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    debug = "--debug" in argv
    try:  # the command's module imports here: a Ctrl-C in it is one more interrupt
        return _invoke(argv)
    except BrokenPipeError:
        if _reader_left():
            return _quiet_after_pipe()
        if debug:
            raise
        return _fail("internal error: BrokenPipeError (rerun with --debug for the traceback)", 1)
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
