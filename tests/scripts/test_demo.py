"""`make demo` works in the recipe's own workdir, so `llmopt run smollm2-w4a16-gptq --dry-run` afterwards
looks where the demo wrote (scripts/demo.sh run with stand-ins for llmopt and python that record their argv)."""
import os
import shlex
import subprocess
from pathlib import Path

from llmopt.recipes.spec import default_workdir, load_recipe

ROOT = Path(__file__).resolve().parents[2]


def _demo_calls(tmp_path, **env) -> dict[str, list[str]]:
    record = tmp_path / "calls.txt"
    stubs = {}
    for name in ("llmopt", "python"):
        stub = tmp_path / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> "{record}"\n')
        stub.chmod(0o755)
        stubs[name] = str(stub)
    run_env = {k: v for k, v in os.environ.items() if k != "DEMO_OUT"}
    run_env.update(LLMOPT=stubs["llmopt"], PYTHON=stubs["python"], **env)
    subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], env=run_env, check=True, capture_output=True)
    calls = [shlex.split(line) for line in record.read_text().splitlines()]
    return {argv[0]: argv[1:] for argv in calls}


def _workdir(argv: list[str]) -> str | None:
    return argv[argv.index("-o") + 1] if "-o" in argv else None


def test_make_demo_runs_the_recipe_in_the_workdir_its_dry_run_looks_at(tmp_path):
    calls = _demo_calls(tmp_path)
    run = calls["llmopt"]
    assert run[0] == "run"
    recipe = load_recipe(run[1])
    assert recipe.name == "smollm2-w4a16-gptq"
    expected = str(default_workdir(recipe))  # what `llmopt run smollm2-w4a16-gptq --dry-run` plans into
    assert _workdir(run) in (None, expected)
    assert calls["python"] == ["scripts/demo_chat.py", f"{expected}/quantize"]


def test_demo_out_moves_both_steps(tmp_path):
    calls = _demo_calls(tmp_path, DEMO_OUT=str(tmp_path / "elsewhere"))
    assert _workdir(calls["llmopt"]) == str(tmp_path / "elsewhere")
    assert calls["python"][1] == f"{tmp_path / 'elsewhere'}/quantize"
