"""Quantize's and prune's `--eval-windows`: every evaluation set the model takes, before and after, each stored
under its own metric key; WikiText-2's numbers stay at the top of `perplexity_before_after`."""
from __future__ import annotations

import pytest

from llmopt.stages.progress import StageHooks
from tests.helpers import few_stdlib_files, make_chat_tokenizer, make_model


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny model whose tokenizer has a chat template (and ChatML's markers as special tokens)."""
    path = tmp_path_factory.mktemp("chat-model")
    tok = make_chat_tokenizer()
    make_model(len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_quantize_stores_each_sets_perplexity_before_and_after(chat_model, tmp_path, monkeypatch):
    few_stdlib_files(monkeypatch)
    from llmopt.stages.quantize.config import QuantizeConfig
    from llmopt.stages.quantize.run import run_quantize

    art = run_quantize(str(chat_model), tmp_path / "q", QuantizeConfig(method="rtn", group_size=16, eval_windows=1))
    metrics = art.manifest["metrics"]
    ba = metrics["perplexity_before_after"]
    assert list(ba["sets"]) == ["wikitext2", "code", "chat"] and ba["skipped"] == {}
    wiki = ba["sets"]["wikitext2"]
    assert ba["protocol"] == "wikitext2 test, seqlen 2048, first 1 windows" and ba["text"] == "wikitext2"
    assert (ba["before"], ba["after"], ba["increase_pct"]) == (wiki["before"], wiki["after"], wiki["increase_pct"])
    for name, entry in ba["sets"].items():
        stored = metrics[entry["metric"]]  # the after model's full result, under the set's own key
        assert stored["perplexity"] == entry["after"] and stored["windows"] == 1 and stored["protocol"]["text"] == name
        assert entry["increase_pct"] == pytest.approx(100 * (entry["after"] / entry["before"] - 1))
        assert entry["before"] > 1 and entry["after"] > 1


def test_a_model_without_a_chat_template_skips_chat_and_says_why(tiny_hf, tmp_path, monkeypatch):
    few_stdlib_files(monkeypatch)
    from llmopt.stages.prune.config import PruneConfig
    from llmopt.stages.prune.run import run_prune

    notes = []
    art = run_prune(str(tiny_hf[0]), tmp_path / "p", PruneConfig(method="magnitude", sparsity=0.5, eval_windows=1),
                    hooks=StageHooks(status=notes.append))
    ba = art.manifest["metrics"]["perplexity_before_after"]
    assert list(ba["sets"]) == ["wikitext2", "code"]
    assert ba["skipped"] == {"chat": "the tokenizer has no chat template"}
    assert "perplexity of the base model: chat skipped (the tokenizer has no chat template)" in notes
    assert [n for n in notes if n.startswith("perplexity of the pruned model")] == [
        "perplexity of the pruned model on 1 windows of wikitext2", "perplexity of the pruned model on 1 windows of code"]
