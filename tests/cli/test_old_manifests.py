"""Artifacts written before group sizes were numbers (manifest `config.group_size` "auto" or "64") still
read: `llmopt inspect`, the quantize table and a recipe's comparison."""
import json

import pytest

from llmopt.cli.main import main
from llmopt.stages.artifact import MANIFEST


@pytest.fixture(scope="module")
def quantized(tiny_hf, tmp_path_factory):
    from llmopt.stages.quantize.config import QuantizeConfig
    from llmopt.stages.quantize.run import run_quantize

    work = tmp_path_factory.mktemp("old-manifests")
    art = run_quantize(str(tiny_hf[0]), work / "quantize", QuantizeConfig(method="rtn", group_size=16, eval_windows=0))
    return work, art


def _with_group_size(art, value) -> None:
    manifest = json.loads((art.path / MANIFEST).read_text())
    manifest["config"]["group_size"] = value  # the manifest is outside the content hash: the artifact stays valid
    (art.path / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("stored, shown", [("64", "group 64"), ("auto", "group auto"), (None, "group auto"),
                                           (16, "group 16"), (-1, "group -1")])
def test_inspect_and_the_quantize_table_read_old_and_new_manifests(quantized, stored, shown, capsys):
    from llmopt.cli.quantize_cmd import render
    from llmopt.stages.artifact import Artifact

    _, art = quantized
    _with_group_size(art, stored)
    assert main(["inspect", str(art.path)]) == 0
    capsys.readouterr()
    opened = Artifact.open(art.path)
    render(opened, opened.manifest["metrics"])
    assert shown in " ".join(capsys.readouterr().out.split())


def test_a_recipes_comparison_reads_an_old_manifest(quantized, tiny_hf):
    from pathlib import Path

    from llmopt.recipes.runner import RecipeRunner
    from llmopt.recipes.spec import parse_recipe

    work, art = quantized
    _with_group_size(art, "auto")
    recipe = parse_recipe(f"source: {tiny_hf[0]}\nstages:\n  - quantize: {{method: rtn, group-size: 16}}\n",
                          Path("r.yaml"))
    rows = {r["name"]: r for r in RecipeRunner(recipe, work).summary()["rows"]}
    assert rows["quantize"]["made_by"] == "rtn W4A16 g16" and rows["quantize"]["size_bytes"] > 0
