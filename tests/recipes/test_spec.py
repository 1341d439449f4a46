"""Recipe files: validated into the subcommands' configs; every mistake is one line naming file:line and key."""
from pathlib import Path

import pytest

from llmopt.cli.main import main
from llmopt.recipes.spec import BUILTIN_DIR, KINDS, RecipeError, load_recipe, parse_recipe
from llmopt.stages import registry
from llmopt.stages.quantize.config import QuantizeConfig

GOOD = """\
source: smollm2-135m
stages:
  - quantize:
      method: gptq
      group-size: 64
      nsamples: 16
  - shard: {tp: 2}
  - eval: {input: [source, quantize], max-windows: 2}
  - bench: {input: shard, slo: {ttft_ms: 500}, prompt-lens: 3}
"""


def parse(text: str):
    return parse_recipe(text, Path("r.yaml"))


def test_a_recipe_becomes_the_stages_configs():
    good = GOOD.replace(", prompt-lens: 3", "")
    recipe = parse(good)
    assert [s.name for s in recipe.stages] == ["quantize", "shard", "eval", "bench"]
    q = recipe.stages[0].built
    assert isinstance(q, QuantizeConfig) and q.group_size == 64 and q.calib.nsamples == 16 and q.method == "gptq"
    assert recipe.stages[1].inputs == ("quantize",) and recipe.stages[1].built.tp == 2
    assert recipe.stages[2].inputs == ("source", "quantize") and recipe.stages[2].built.max_windows == 2
    bench = recipe.stages[3].built
    assert recipe.stages[3].inputs == ("shard",) and bench.load.slo == {"ttft_ms": 500.0}
    assert recipe.stages[0].given == {"method": "gptq", "group_size": "64", "nsamples": 16}


def test_options_are_the_stages_own():
    def options_of(kind):
        return registry.stage(kind).options

    assert {"method", "scheme", "group_size", "nsamples", "eval_windows"} <= set(options_of("quantize"))
    assert "output" not in options_of("quantize") and "json" not in options_of("eval")
    assert options_of("quantize")["nsamples"].default == 128
    assert set(options_of("shard")) == {"tp", "pp", "pp_layers", "pp_balance"}
    assert KINDS == registry.KINDS
    for kind in KINDS:
        assert options_of(kind)


@pytest.mark.parametrize("text, expect", [
    (GOOD, "r.yaml:9: stage bench: unknown key 'prompt-lens'"),
    (GOOD.replace("nsamples: 16", "nsamples: lots"), "r.yaml:6: stage quantize: nsamples: expected a whole number"),
    (GOOD.replace("group-size: 64", "group-size: 48"), "r.yaml:5: stage quantize: --group-size must be"),
    (GOOD.replace("method: gptq", "method: gptq\n      method: rtn"), "r.yaml:5: method is given twice"),
    (GOOD.replace("{tp: 2}", "{tp: two}"), "r.yaml:7: stage shard: tp: expected a whole number"),
    (GOOD.replace("- shard:", "- serve:"), "r.yaml:7: unknown stage 'serve'"),
    (GOOD.replace("input: shard", "input: eval"), "r.yaml:9: stage bench: input 'eval' is neither the source"),
    (GOOD.replace("input: [source, quantize]", "input: later"), "r.yaml:8: stage eval: input 'later'"),
    (GOOD.replace("source: smollm2-135m\n", ""), "r.yaml:1: the recipe needs a source: key"),
    (GOOD.replace("stages:", "stagez:"), "r.yaml:2: recipe: unknown key 'stagez'"),
    (GOOD.replace("  - shard: {tp: 2}", "  - shard: {tp: 2"), "r.yaml:"),
    ("- just a list\n", "r.yaml:1: a recipe is a mapping"),
    (GOOD.replace("- shard: {tp: 2}", "- shard: {tp: 2}\n    quantize: {}"), "r.yaml:7: stage 2: write one stage"),
    (GOOD.replace("- shard: {tp: 2}", "- quantize: {}"), "r.yaml:7: stage quantize: the name is taken"),
    (GOOD.replace("nsamples: 16", "asym: 1"), "r.yaml:6: stage quantize: asym: expected true or false"),
    (GOOD.replace("max-windows: 2", "max-windows: 0"), "r.yaml:8: stage eval: --max-windows must be at least 1"),
])
def test_mistakes_name_file_line_and_key(text, expect):
    with pytest.raises(RecipeError) as e:
        parse(text)
    assert str(e.value).startswith(expect), str(e.value)
    assert "\n" not in str(e.value)


def test_the_cli_prints_one_line_and_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("nsamples: 16", "nsampels: 16"))
    assert main(["run", str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bad}:6: stage quantize: unknown key 'nsampels'" in err[0]
    assert main(["run", "no-such-recipe"]) == 2
    assert "not a built-in recipe (built-in: smollm2-" in capsys.readouterr().err


def test_builtin_recipes_are_documented_and_valid():
    recipes = sorted(BUILTIN_DIR.glob("*.yaml"))
    assert {"smollm2-w4a16-gptq", "smollm2-w8a8-smoothquant", "smollm2-2of4-sparsegpt-w4a16", "smollm2-mlp25-w4a16",
            "smollm2-tp4"} <= {p.stem for p in recipes}
    for path in recipes:
        header = path.read_text().split("\n", 1)[0]
        assert header.startswith("# "), f"{path.name} has no comment header"
        assert "Expected" in path.read_text(), f"{path.name} does not say what to expect"
        recipe = load_recipe(path.stem)
        assert recipe.name == path.stem and recipe.source == "smollm2-135m"
