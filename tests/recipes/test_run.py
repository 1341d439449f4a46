"""llmopt run on a tiny random model: every built-in recipe plans (dry run), one recipe runs for real,
re-running skips every finished stage, and a changed option reruns exactly what it affects."""
import json

import pytest

from llmopt.cli.main import main
from llmopt.recipes.runner import RecipeRunner
from llmopt.recipes.spec import BUILTIN_DIR, load_recipe, parse_recipe

SMALL = """\
source: {src}
stages:
  - quantize: {{method: gptq, scheme: W4A16, group-size: 16, nsamples: 4, seqlen: 64, eval-windows: 0}}
  - shard: {{tp: 2}}
  - eval: {{input: [source, quantize], text: wikitext2, seqlen: 64, max-windows: 2}}
  - profile:
      input: [source, quantize]
      prompt-lens: [16]
      batch-sizes: [1, 2]
      context-lens: [16]
      decode-context: 16
      decode-steps: 2
      repeats: 1
      plan-context: 64
      memory-budget: 64MiB
  - bench:
      input: [quantize, shard]
      num-prompts: 3
      input-len: 8
      output-len: 4
      ignore-eos: true
      warmup: 0
      fail-on: "completed<3"
"""


@pytest.fixture
def tiny_recipe(tiny_hf, tmp_path, isolated_cache):
    path = tmp_path / "small.yaml"
    path.write_text(SMALL.format(src=tiny_hf[0]))
    return path


@pytest.mark.parametrize("path", sorted(BUILTIN_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_builtin_recipe_plans_on_a_tiny_model(path, tiny_hf, tmp_path, capsys):
    tiny = tmp_path / f"{path.stem}.yaml"
    tiny.write_text(path.read_text().replace("source: smollm2-135m", f"source: {tiny_hf[0]}"))
    assert main(["run", str(tiny), "-o", str(tmp_path / "work"), "--dry-run"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    recipe = load_recipe(tiny)
    for spec in recipe.stages:
        assert f"llmopt {spec.kind}" in printed
    plan = RecipeRunner(recipe, tmp_path / "work").plan()
    assert [p.action for p in plan] == ["run"] * len(recipe.stages)
    assert not (tmp_path / "work").exists()  # a dry run writes nothing


def _records(work):
    return {p.stem: json.loads(p.read_text()) for p in (work / ".llmopt-run").glob("*.json")}


@pytest.mark.integration
def test_a_recipe_runs_then_skips_then_reruns_what_changed(tiny_recipe, tmp_path, capsys):
    work = tmp_path / "work"
    assert main(["run", str(tiny_recipe), "-o", str(work), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in summary["rows"]}
    assert list(rows) == ["source", "quantize", "shard"]
    assert rows["quantize"]["size_bytes"] < rows["source"]["size_bytes"]
    assert rows["source"]["perplexity"] > 1 and rows["quantize"]["perplexity"] > 1
    assert rows["source"]["decode_tok_s"] > 0 and rows["quantize"]["decode_tok_s"] > 0  # from the profile
    assert rows["shard"]["output_tok_s"] > 0 and rows["quantize"]["p99_ttft_ms"] > 0  # from the bench
    assert (work / "shard" / "llmopt.json").is_file() and (work / "profile" / "profile.html").is_file()
    first = _records(work)
    assert set(first) == {"quantize", "shard", "eval", "profile", "bench"}

    # Again: every stage is skipped, nothing is rewritten.
    assert main(["run", str(tiny_recipe), "-o", str(work)]) == 0
    err = capsys.readouterr().err
    assert err.count("skipped (up to date)") == 5
    assert _records(work) == first

    # A changed eval option reruns eval only; the dry run says so first.
    tiny_recipe.write_text(tiny_recipe.read_text().replace("max-windows: 2", "max-windows: 1"))
    plan = RecipeRunner(load_recipe(tiny_recipe), work).plan()
    assert {p.spec.name: p.action for p in plan} == {"quantize": "skip", "shard": "skip", "eval": "run",
                                                      "profile": "skip", "bench": "skip"}
    assert main(["run", str(tiny_recipe), "-o", str(work)]) == 0
    second = _records(work)
    assert second["eval"]["finished"] != first["eval"]["finished"]
    assert all(second[n]["finished"] == first[n]["finished"] for n in ("quantize", "shard", "profile", "bench"))

    # --from reruns that stage and the ones after it; GPTQ is deterministic, so the artifact's hash holds.
    capsys.readouterr()
    assert main(["run", str(tiny_recipe), "-o", str(work), "--from", "shard"]) == 0
    third = _records(work)
    assert third["quantize"]["finished"] == second["quantize"]["finished"]
    assert all(third[n]["finished"] != second[n]["finished"] for n in ("shard", "eval", "profile", "bench"))
    assert main(["run", str(tiny_recipe), "-o", str(work), "--from", "nope"]) == 2
    assert "--from nope: no such stage" in capsys.readouterr().err


def test_an_interrupted_run_resumes_at_the_unfinished_stage(tiny_hf, tmp_path, isolated_cache, monkeypatch):
    text = (f"source: {tiny_hf[0]}\nstages:\n  - quantize: {{method: rtn, scheme: W8A16, eval-windows: 0}}\n"
            "  - eval: {seqlen: 64, max-windows: 1}\n")
    recipe = parse_recipe(text, tmp_path / "r.yaml")
    work = tmp_path / "work"
    runner = RecipeRunner(recipe, work)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    import llmopt.stages.eval.run as eval_run

    monkeypatch.setattr(eval_run, "evaluate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.run()
    assert set(_records(work)) == {"quantize"} and not (work / "eval").exists()
    monkeypatch.undo()
    outcomes = RecipeRunner(recipe, work).run()
    assert [o.action for o in outcomes] == ["skipped", "ran"]


def test_a_failed_bench_gate_fails_the_run_and_leaves_the_stage_unfinished(tiny_hf, tmp_path, isolated_cache, capsys):
    text = (f"source: {tiny_hf[0]}\nstages:\n  - bench: {{num-prompts: 2, input-len: 8, output-len: 2, warmup: 0, "
            "fail-on: 'completed<100'}\n")
    path = tmp_path / "gate.yaml"
    path.write_text(text)
    assert main(["run", str(path), "-o", str(tmp_path / "work")]) == 1
    assert "stage bench: source: completed" in capsys.readouterr().err
    assert not (tmp_path / "work" / ".llmopt-run" / "bench.json").exists()
    assert (tmp_path / "work" / "bench" / "source.json").is_file()  # the report is kept to look at
