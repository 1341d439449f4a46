"""`llmopt eval --text A,B`: the model loaded once, one table row, one protocol line and one stored metric per set;
`--json` keyed by set; a bad name in the list fails in one line before any model loads."""
import json
import platform

import pytest

from llmopt.cli.main import main
from llmopt.stages.artifact import Artifact
from tests.helpers import few_stdlib_files

EVAL = ["--seqlen", "32", "--max-windows", "1"]


def test_eval_measures_each_set_of_a_list(tiny_hf, tmp_path, capsys, monkeypatch):
    import llmopt.stages.eval.run as eval_run

    few_stdlib_files(monkeypatch)
    art = tmp_path / "art"
    assert main(["import", str(tiny_hf[0]), "-o", str(art)]) == 0
    loads, load = [], eval_run.load
    monkeypatch.setattr(eval_run, "load", lambda *args, **kw: loads.append(args) or load(*args, **kw))
    capsys.readouterr()
    assert main(["eval", str(art), "--text", "wikitext2,code", *EVAL]) == 0
    out = capsys.readouterr().out
    assert len(loads) == 1
    rows = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    assert rows == ["wikitext2", "code"]
    assert "  wikitext2: " in out and f"  code: Python {platform.python_version()} standard library" in out
    metrics = Artifact.open(art).manifest["metrics"]
    keys = sorted(k for k in metrics if k.startswith("eval/"))
    assert keys == [f"eval/code-py{platform.python_version()}/seqlen32/windows-1", "eval/wikitext2/seqlen32/windows-1"]

    assert main(["eval", str(art), "--text", "wikitext2,code", *EVAL, "--no-store", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data) == ["wikitext2", "code"]
    assert data["code"]["perplexity"] == pytest.approx(metrics[keys[0]]["perplexity"])
    assert data["code"]["protocol"]["python"] == platform.python_version() and len(data["code"]["window_nll"]) == 1


def test_a_bad_name_in_the_list_fails_in_one_line_before_loading(tiny_hf, capsys, monkeypatch):
    def no_load(*args, **kw):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("llmopt.stages.eval.run.run_evals", no_load)
    assert main(["eval", str(tiny_hf[0]), "--text", "wikitext2,cod", *EVAL]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1
    assert "--text cod: no such text file and not a built-in name" in err and "code, chat" in err


def test_chat_on_a_model_without_a_chat_template_fails_before_any_set_is_measured(tiny_hf, capsys, monkeypatch):
    measured = []
    monkeypatch.setattr("llmopt.stages.eval.run.evaluate", lambda *args, **kw: measured.append(args))
    assert main(["eval", str(tiny_hf[0]), "--text", "wikitext2,chat", *EVAL]) == 2
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]  # after the "loading" note: the error, in one line
    assert last.startswith("error:") and "--text chat: the tokenizer has no chat template" in last
    assert measured == []
