"""What any command-line tool is expected to do: --version, help when run alone, quiet on a closed pipe,
shell completion, readable --help (no <bool> beside flags, nothing cut at 80 columns), its environment listed."""
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from llmopt.cli.main import ENVIRONMENT, main

ROOT = Path(__file__).resolve().parents[2]
LLMOPT = [sys.executable, "-m", "llmopt.cli.main"]


def _help(argv, capsys, monkeypatch) -> str:
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("TERMINAL_WIDTH", raising=False)
    assert main(argv) == 0
    return capsys.readouterr().out


def test_version_is_the_installed_distribution_s(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"llmopt {version('llmopt')}\n"


def test_llmopt_alone_prints_the_help_and_exits_0(capsys):
    assert main([]) == 0
    out, err = capsys.readouterr()
    assert "Usage: llmopt" in out and "quantize" in out
    assert err == ""


@pytest.mark.parametrize("argv", [["bench", "--help"], ["--help"], ["--version"]])
def test_output_into_a_closed_pipe_exits_0_without_a_word(argv):
    # `llmopt bench --help | head -3`, with the reader already gone: every write meets EPIPE
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(LLMOPT + argv, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (0, "")


def test_a_broken_pipe_elsewhere_is_still_an_error(monkeypatch, capsys):
    # a socket's EPIPE inside a command is a failure, not a reader that had enough
    import llmopt.cli.main as cli

    def broken(argv):
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(cli, "_invoke", broken)
    monkeypatch.setattr(cli, "_reader_left", lambda: False)
    assert main(["inspect", "x"]) == 1
    assert "internal error: BrokenPipeError" in capsys.readouterr().err


def test_completion_completes_commands_and_options():
    env = dict(os.environ, _LLMOPT_COMPLETE="complete_bash", COMP_WORDS="llmopt serve --max-n", COMP_CWORD="2")
    done = subprocess.run(LLMOPT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert set(done.stdout.split()) == {"--max-num-seqs", "--max-num-batched-tokens"}
    env.update(COMP_WORDS="llmopt be", COMP_CWORD="1")
    assert subprocess.run(LLMOPT, env=env, capture_output=True, text=True, timeout=120).stdout.split() == ["bench"]


def test_install_completion_writes_the_bash_script(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path), SHELL="/bin/bash")
    # `; true` keeps bash alive as the parent, where typer looks for the shell
    command = " ".join(LLMOPT) + " --install-completion; true"
    done = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=120)
    assert "completion installed" in done.stdout, done.stderr
    script = (tmp_path / ".bash_completions" / "llmopt.sh").read_text()
    assert "_LLMOPT_COMPLETE=complete_bash" in script
    assert str(tmp_path / ".bash_completions" / "llmopt.sh") in (tmp_path / ".bashrc").read_text()


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["serve", "--help"], ["eval", "--help"]])
def test_help_shows_no_placeholder_beside_a_flag(argv, capsys, monkeypatch):
    out = _help(argv, capsys, monkeypatch)
    assert "<bool>" not in out
    assert re.search(r"--help +Show this message", out)


@pytest.mark.parametrize("argv", [["bench", "--help"], ["serve", "--help"], ["quantize", "--help"]])
def test_piped_help_is_not_cut_at_80_columns(argv, capsys, monkeypatch):
    out = _help(argv, capsys, monkeypatch)
    assert "…" not in out
    if argv[0] == "bench":
        assert "p99_ttft_ms>500, output_throughput<50" in out and "--num-speculative-tokens" in out


def test_help_lists_every_environment_variable_llmopt_reads(capsys, monkeypatch):
    read = set()
    for folder in ("cli", "stages", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            read |= set(re.findall(r"\bLLMOPT_[A-Z_]+", path.read_text()))
    from llmopt.stages.bench.server import LLAMA_SERVER_ENV
    read.add(LLAMA_SERVER_ENV)
    listed = {name for name, _ in ENVIRONMENT}
    assert read <= listed, f"add to ENVIRONMENT in cli/main.py: {sorted(read - listed)}"
    out = _help(["--help"], capsys, monkeypatch)
    assert all(name in out for name in listed)
