"""Artifacts written before group sizes were numbers (manifest `config.group_size` "auto" or "64"), and before the
stages measured every evaluation set (`perplexity_before_after` with WikiText-2 only, a recipe's eval.json with one
record per input), still read: `llmopt inspect`, the quantize table and a recipe's comparison."""
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


OLD_PPL = {"protocol": "wikitext2 test, seqlen 2048, first 4 windows", "before": 20.0, "after": 21.0,
           "increase_pct": 5.0}  # before the stages measured every evaluation set
NEW_PPL = {**OLD_PPL, "text": "wikitext2", "sets_protocol": "seqlen 2048, first 4 windows of each set",
           "sets": {"wikitext2": {"before": 20.0, "after": 21.0, "increase_pct": 5.0, "metric": "eval/wikitext2/..."},
                    "code": {"before": 3.0, "after": 3.3, "increase_pct": 10.0, "metric": "eval/code-py3/..."}},
           "skipped": {"chat": "the tokenizer has no chat template"}}


@pytest.mark.parametrize("stored, shown", [
    (OLD_PPL, ["perplexity 20.0000 -> 21.0000 (+5.00%), wikitext2 test, seqlen 2048, first 4 windows"]),
    (NEW_PPL, ["perplexity wikitext2 20.0000 -> 21.0000 (+5.00%)", "perplexity code 3.0000 -> 3.3000 (+10.00%)",
               "perplexity protocol seqlen 2048, first 4 windows of each set; chat skipped: the tokenizer has no "
               "chat template"]),
])
def test_the_quantize_table_and_inspect_show_each_sets_before_and_after(quantized, stored, shown, capsys):
    from llmopt.cli.quantize_cmd import render
    from llmopt.stages.artifact import Artifact

    _, art = quantized
    Artifact.open(art.path).update_metrics("perplexity_before_after", stored)
    opened = Artifact.open(art.path)
    render(opened, opened.manifest["metrics"])
    table = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert all(line in table for line in shown), table
    assert main(["inspect", str(art.path)]) == 0
    inspected = " ".join(capsys.readouterr().out.replace("│", " ").split())
    expected = ("perplexity_before_after: code 3.0000 -> 3.3000" if "sets" in stored
                else "perplexity_before_after 20.0000 -> 21.0000 (+5.00%), wikitext2 test")
    assert expected in inspected, inspected


def _record(ppl: float) -> dict:
    return {"perplexity": ppl, "windows": 2, "windows_available": 148,
            "protocol": {"name": "gptq-style non-overlapping windows", "seqlen": 2048}}


@pytest.mark.parametrize("eval_json, code", [
    ({"metric": "eval/wikitext2/seqlen2048/windows-2", "results": {"source": _record(20.0), "quantize": _record(21.0)}},
     None),
    ({"metrics": {"wikitext2": "eval/wikitext2/seqlen2048/windows-2", "code": "eval/code-py3/seqlen2048/windows-2"},
      "results": {"source": {"wikitext2": _record(20.0), "code": _record(3.0)},
                  "quantize": {"wikitext2": _record(21.0), "code": _record(3.3)}}}, 3.3),
])
def test_a_recipes_comparison_reads_old_and_new_eval_results(quantized, tiny_hf, eval_json, code, capsys):
    from pathlib import Path

    from llmopt.cli.run_view import render_summary
    from llmopt.recipes.runner import RecipeRunner
    from llmopt.recipes.spec import parse_recipe

    work, _ = quantized
    (work / "eval").mkdir(exist_ok=True)
    (work / "eval" / "eval.json").write_text(json.dumps(eval_json))
    recipe = parse_recipe(f"source: {tiny_hf[0]}\nstages:\n  - quantize: {{method: rtn, group-size: 16}}\n"
                          "  - eval: {input: [source, quantize], max-windows: 2}\n", Path("r.yaml"))
    summary = RecipeRunner(recipe, work).summary()
    rows = {r["name"]: r for r in summary["rows"]}
    assert (rows["source"]["perplexity"], rows["quantize"]["perplexity"]) == (20.0, 21.0)
    assert rows["quantize"]["perplexity_sets"] == ({} if code is None else {"code": code})
    render_summary(summary)
    header = capsys.readouterr().out
    assert ("ppl code" in header) == (code is not None)
