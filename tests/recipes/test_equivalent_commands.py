"""The "equivalent commands" `llmopt run --dry-run` prints can be pasted: each one parses as the CLI
takes it, for every built-in recipe, and those of a tiny recipe run and make what the recipe makes."""
import shlex

import pytest

from llmopt.cli.main import main
from llmopt.recipes.runner import RecipeRunner
from llmopt.recipes.spec import BUILTIN_DIR, load_recipe
from llmopt.stages.artifact import Artifact
from tests.cli.paste import parse_command

HEADER = "equivalent commands:"


def printed_commands(out: str) -> list[list[str]]:
    """The argv of each line after the plan's 'equivalent commands:' (its `# N. stage` comment dropped)."""
    lines = out.split(HEADER, 1)[1].splitlines()
    return [argv for argv in (shlex.split(line, comments=True) for line in lines) if argv]


@pytest.mark.parametrize("path", sorted(BUILTIN_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_equivalent_command_of_a_builtin_recipe_parses(path, tmp_path, isolated_cache, capsys):
    assert main(["run", path.stem, "-o", str(tmp_path / "work"), "--dry-run"]) == 0
    commands = printed_commands(capsys.readouterr().out)
    recipe = load_recipe(path)
    # eval and bench read one model per command: one line per input; the others one line per stage
    expected = sum(len(s.inputs) if s.kind in ("eval", "bench") else 1 for s in recipe.stages)
    assert len(commands) == expected, commands
    for argv in commands:
        ctx = parse_command(argv)
        assert ctx.info_name == argv[1]  # the stage's own command, not a bench subcommand named by a source
    kinds = [argv[1] for argv in commands]
    assert sorted(set(kinds)) == sorted({s.kind for s in recipe.stages})
    first = RecipeRunner(recipe, tmp_path / "work").plan()[0]  # reads the source, not yet imported (empty cache)
    assert first.why.startswith("its source is not imported yet"), first.why


def test_an_artifact_stage_names_its_output_and_bench_one_server_per_input():
    from pathlib import Path

    from llmopt.cli.run_view import commands
    from llmopt.recipes.spec import parse_recipe

    recipe = parse_recipe("source: m\nstages:\n  - quantize: {method: rtn, scheme: W8A16, eval-windows: 0}\n"
                          "  - bench: {input: [source, quantize], ignore-eos: true, disable-shuffle: false}\n", Path("r.yaml"))
    quantize, bench = recipe.stages
    assert commands(quantize, ["m"], Path("w/quantize")) == [
        "llmopt quantize m -o w/quantize --force --method rtn --scheme W8A16 --eval-windows 0"]
    assert commands(bench, ["m", "w/quantize"], Path("w/bench")) == [
        "llmopt bench --server m --ignore-eos", "llmopt bench --server w/quantize --ignore-eos"]


TINY = """\
source: {src}
stages:
  - quantize: {{method: rtn, scheme: W8A16, group-size: 16, eval-windows: 0}}
  - shard: {{tp: 2}}
  - eval: {{input: [source, quantize], text: wikitext2, seqlen: 64, max-windows: 1}}
"""


@pytest.mark.integration
def test_the_equivalent_commands_of_a_tiny_recipe_run_and_make_what_the_recipe_makes(tiny_hf, tmp_path,
                                                                                        isolated_cache, capsys):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY.format(src=tiny_hf[0]))
    pasted, ran = tmp_path / "pasted", tmp_path / "ran"
    assert main(["run", str(recipe), "-o", str(pasted), "--dry-run"]) == 0
    commands = printed_commands(capsys.readouterr().out)
    assert [argv[1] for argv in commands] == ["quantize", "shard", "eval", "eval"]
    for argv in commands:
        assert main(argv[1:]) == 0, shlex.join(argv)
    assert main(["run", str(recipe), "-o", str(ran)]) == 0
    for stage in ("quantize", "shard"):
        assert Artifact.open(pasted / stage).content_hash == Artifact.open(ran / stage).content_hash
