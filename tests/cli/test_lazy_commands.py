"""`llmopt COMMAND` imports that command's module only; help, no command and an unknown one see every command."""
import subprocess
import sys

import pytest
import typer

from llmopt.cli.main import BENCH_COMMANDS, COMMANDS, app, build_app, main

EVERY = [name for name, _, _ in COMMANDS] + ["bench"]
# what the process ran, then the command modules (llmopt.cli.*_cmd) it had imported, one line
REPORT = ("import contextlib, io, sys; from llmopt.cli.main import main; sys.argv[0] = 'llmopt'\n"
          "with contextlib.redirect_stdout(io.StringIO()): code = main()\n"
          "print(code, ' '.join(sorted(m[len('llmopt.cli.'):] for m in sys.modules "
          "if m.startswith('llmopt.cli.') and m.endswith('_cmd'))))")


@pytest.mark.parametrize("argv, imported", [
    (["inspect", "--help"], "inspect_cmd"),
    (["--debug", "serve", "--help"], "serve_cmd"),
    (["bench", "compare", "--help"], "bench_compare_cmd"),
    (["--debug", "bench", "summary", "--help"], "bench_summary_cmd"),
])
def test_a_command_imports_only_its_module(argv, imported):
    done = subprocess.run([sys.executable, "-c", REPORT, *argv], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == f"0 {imported}", done.stderr


def _commands(argv) -> list[str]:
    return list(typer.main.get_command(build_app(argv)).commands)


@pytest.mark.parametrize("argv", [None, [], ["--help"], ["--debug"], ["--help", "serve"], ["frobnicate"],
                                  ["--debug", "frobnicate", "serve"], ["--debug=1", "serve"]])
def test_help_and_unknown_commands_see_every_command_in_order(argv):
    assert _commands(argv) == list(typer.main.get_command(app).commands) == EVERY


@pytest.mark.parametrize("argv, commands", [
    (["serve", "model"], ["serve"]), (["--debug", "--debug", "inspect", "bench"], ["inspect"]),
    (["bench", "--url", "x"], ["bench"]), (["run", "--help"], ["run"]),
])
def test_the_command_argv_names_is_the_only_one(argv, commands):
    assert _commands(argv) == commands


@pytest.mark.parametrize("argv, subcommands", [
    (["bench"], ["compare", "summary"]), (["bench", "--quiet", "compare"], ["compare", "summary"]),
    (["bench", "compare", "a", "b"], ["compare"]), (["bench", "summary", "dir"], ["summary"]),
])
def test_bench_builds_the_subcommand_argv_names(argv, subcommands):
    bench = typer.main.get_command(build_app(argv)).commands["bench"]
    assert list(bench.commands) == subcommands
    assert bool(bench.params) == (len(subcommands) == len(BENCH_COMMANDS))  # bench's own options only when needed


@pytest.mark.parametrize("name", EVERY)
def test_a_command_alone_is_the_same_command_as_in_the_full_app(name):
    alone = typer.main.get_command(build_app([name])).commands[name]
    full = typer.main.get_command(app).commands[name]
    assert (alone.help, [p.opts for p in alone.params]) == (full.help, [p.opts for p in full.params])


def test_a_near_miss_is_one_line_with_a_suggestion(capsys):
    assert main(["serv"]) == 2
    assert capsys.readouterr().err.strip() == "error: No such command 'serv'. Did you mean 'serve'?"


def test_ctrl_c_while_the_command_module_imports_is_one_line_and_130():
    # The command's module imports inside main(): simulate the interrupt landing in that import.
    code = """
import sys
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "llmopt.cli.inspect_cmd":
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupt())
from llmopt.cli.main import main
sys.exit(main(["inspect", "/no/such"]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (130, "error: interrupted\n")
