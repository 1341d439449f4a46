"""`llmopt export` on the embedded SmolLM2-135M: RTN W4A16 group 32 (bf16 scales) becomes Q4_0 bit for bit, read
back by the gguf package and by transformers (`gguf_file=`), and the tokenizer metadata is the source GGUF's own."""
import json
import warnings

import gguf
import numpy as np
import pytest
import torch

from llmopt.cli.main import main
from llmopt.stages.eval.config import EvalConfig
from llmopt.stages.eval.measure import evaluate
from llmopt.stages.model_io import load_gguf, load_model_dir
from llmopt.stages.source import resolve
from tests.stages.export.reference import artifact_weights, gguf_fields, gguf_weights

pytestmark = pytest.mark.integration
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.padding_token_id", "tokenizer.chat_template", "llama.rope.freq_base",
                  "llama.attention.layer_norm_rms_epsilon", "llama.context_length", "general.name")


def test_w4a16_g32_exports_to_q4_0_bit_for_bit(smollm_bf16, tmp_path, capsys):
    art, path = tmp_path / "w4", tmp_path / "smollm2-w4.gguf"
    assert main(["quantize", str(smollm_bf16), "-o", str(art), "--method", "rtn", "--group-size", "32",
                 "--eval-windows", "0", "--json"]) == 0
    capsys.readouterr()
    assert main(["export", str(art), "--format", "gguf", "-o", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["counts"] == {"exact": {"Q4_0": 210}, "dense": {"BF16": 1, "F32": 61}}
    assert report["lineage"] == ["import", "quantize"] and report["file_type"] == "MOSTLY_Q4_0"
    config, reader = json.loads((art / "config.json").read_text()), gguf.GGUFReader(path)  # parsed once: seconds
    ours, theirs = artifact_weights(art), gguf_weights(reader, config)
    assert set(theirs) == set(ours)  # the tied lm_head is token_embd
    assert all(np.array_equal(w, ours[name]) for name, (_, w) in theirs.items())
    mine, source = gguf_fields(reader), gguf_fields(resolve("smollm2-135m").path)
    for key in TOKENIZER_KEYS:
        assert mine[key] == source[key], key
    del reader, theirs
    with warnings.catch_warnings():  # transformers' own loader (`gguf_file=`), as `llmopt import FILE.gguf` runs it
        warnings.simplefilter("ignore")
        model, tokenizer = load_gguf(path)
    loaded, dequantized = model.state_dict(), load_model_dir(art, dtype=torch.float32).state_dict()
    assert set(loaded) == set(dequantized)
    assert all(torch.equal(loaded[k], dequantized[k]) for k in dequantized)  # transformers' own dequantization
    del loaded, dequantized
    # the artifact in fp32 through `llmopt eval`, and the GGUF as transformers read it (config, tokenizer, weights)
    assert main(["eval", str(art), "--max-windows", "1", "--dtype", "fp32", "--no-store", "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)["wikitext2"]["perplexity"]
    theirs = evaluate(model, tokenizer, EvalConfig(max_windows=1, dtype="fp32")).perplexity
    assert theirs == pytest.approx(ours, rel=1e-4)
