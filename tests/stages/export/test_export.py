"""`run_export` on tiny random Llamas: Q4_0 / Q8_0 bit for bit, refusals that leave nothing behind,
--allow-requantize saying what it did, the metadata llama.cpp reads, and transformers loading the file."""
import json
import warnings

import numpy as np
import pytest
import torch

from llmopt.stages.errors import ArtifactError, ConfigError
from llmopt.stages.export.config import REQUANTIZE_TYPES, ExportConfig
from llmopt.stages.export.run import run_export
from tests.stages.export.reference import artifact_weights, gguf_fields, gguf_weights

IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 200, 17, 4]])


def _export(art, tmp_path, **config):
    return run_export(str(art), tmp_path / "model.gguf", ExportConfig(**config))


def _config(art) -> dict:
    return json.loads((art / "config.json").read_text())


def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".llmopt-tmp"))


@pytest.mark.parametrize("name, quantized_type, expect", [
    ("w4_bf16", "Q4_0", {"Q4_0": 14, "Q8_0": 1, "F32": 5}),  # the int8 g32 embedding is Q8_0 too
    ("w4_fp16", "Q4_0", {"Q4_0": 14, "F16": 2, "F32": 5}),  # untied: a dense F16 embedding and output
    ("w8_fp16", "Q8_0", {"Q8_0": 14, "F16": 1, "F32": 5}),
    ("w8_bf16", "Q8_0", {"Q8_0": 14, "BF16": 1, "F32": 5}),
])
def test_every_tensor_reads_back_bit_for_bit(quantized, tmp_path, name, quantized_type, expect):
    art = quantized(name)
    result = _export(art, tmp_path)
    assert result.requantized == [] and "refused" not in result.counts()
    ours, theirs = artifact_weights(art), gguf_weights(result.path, _config(art))
    tied = _config(art)["tie_word_embeddings"]
    assert set(theirs) == set(ours) - ({"lm_head.weight"} if tied else set())  # llama.cpp reuses token_embd
    for key, (qtype, w) in theirs.items():
        assert np.array_equal(w, ours[key]), key
    types = {}
    for qtype, _ in theirs.values():
        types[qtype] = types.get(qtype, 0) + 1
    assert types == expect
    assert result.file_type == f"MOSTLY_{quantized_type}"


def test_transformers_loads_the_file_with_the_artifact_s_weights_tokens_and_logits(quantized, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmopt.stages.model_io import load_model_dir, load_tokenizer

    art = quantized("w4_bf16")
    result = _export(art, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=result.path.name, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=result.path.name)
    ours = load_model_dir(art, dtype=torch.float32).eval()
    mine, other = ours.state_dict(), theirs.state_dict()
    assert set(mine) == set(other)
    assert all(torch.equal(mine[k], other[k]) for k in mine)
    with torch.no_grad():
        a, b = ours(IDS).logits, theirs(IDS).logits
        assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()
        greedy = dict(max_new_tokens=12, do_sample=False)
        assert torch.equal(ours.generate(IDS, **greedy), theirs.generate(IDS, **greedy))
    text = "the quick brown fox, 42 jumps <eos> over"
    assert tok(text).input_ids == load_tokenizer(art)(text).input_ids


def test_metadata_llama_cpp_reads_and_the_lineage(quantized, tmp_path):
    import gguf

    art = quantized("w8_fp16")
    result = _export(art, tmp_path)
    f = gguf_fields(result.path)
    assert f["general.architecture"] == "llama" and f["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert (f["llama.block_count"], f["llama.embedding_length"], f["llama.feed_forward_length"]) == (2, 32, 64)
    assert (f["llama.attention.head_count"], f["llama.attention.head_count_kv"], f["llama.rope.dimension_count"]) \
        == (4, 2, 8)
    assert f["llama.vocab_size"] == len(f["tokenizer.ggml.tokens"]) == 300
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt2"
    assert f["tokenizer.ggml.tokens"][0] == "<eos>" and f["tokenizer.ggml.token_type"][0] == gguf.TokenType.CONTROL
    assert f["tokenizer.ggml.eos_token_id"] == 0 and len(f["tokenizer.ggml.merges"]) == result.tokenizer["merges"] > 0
    assert f["tokenizer.chat_template"].startswith("{% for m in messages %}")
    manifest = json.loads((art / "llmopt.json").read_text())
    assert json.loads(f["llmopt.lineage"]) == manifest["lineage"]
    assert [e["stage"] for e in manifest["lineage"]] == ["quantize"]
    assert json.loads(f["llmopt.source"]) == manifest["source"]
    assert json.loads(f["llmopt.export"])["content_hash"] == manifest["content_hash"]


@pytest.mark.parametrize("name, tensor, reason", [
    ("w4_auto", "model.layers.0.mlp.down_proj (blk.0.ffn_down.weight)", "int4 group 64 has no exact GGUF type"),
    ("w4_fp32", "model.layers.0.self_attn.k_proj (blk.0.attn_k.weight)", "float32 scales are not all fp16 numbers"),
    ("w4_asym", "model.layers.0.self_attn.k_proj (blk.0.attn_k.weight)", "asymmetric int4 has no exact GGUF type"),
    ("w8a8", "model.layers.0.self_attn.k_proj (blk.0.attn_k.weight)", "W8A8"),
])
def test_no_exact_type_is_one_line_naming_the_tensor_and_leaves_no_file(quantized, tmp_path, name, tensor, reason):
    with pytest.raises(ConfigError) as e:
        _export(quantized(name), tmp_path)
    message = str(e.value)
    assert "\n" not in message and f"export: {tensor}: " in message and reason in message
    assert "--allow-requantize" in message
    assert list(tmp_path.iterdir()) == []


def test_allow_requantize_names_what_it_re_quantized(quantized, tmp_path):
    art = quantized("w4_auto")
    result = _export(art, tmp_path, allow_requantize="q8_0")
    assert [t.name for t in result.requantized] == [f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)]
    assert all(t.qtype == "Q8_0" and "group 64" in t.why and "dequantized" in t.method for t in result.requantized)
    assert result.counts()["exact"] == {"Q4_0": 12}
    ours, theirs = artifact_weights(art), gguf_weights(result.path, _config(art))
    for t in result.requantized:  # Q8_0 of an int4 grid: close, not equal
        qtype, w = theirs[t.name]
        assert qtype == "Q8_0" and not np.array_equal(w, ours[t.name])
        assert np.abs(w - ours[t.name]).max() <= np.abs(ours[t.name]).max() / 127
    recorded = json.loads(gguf_fields(result.path)["llmopt.export"])["requantized"]
    assert [r["name"] for r in recorded] == [t.name for t in result.requantized]


# the largest error a type may add, relative to the tensor's largest weight (half a step of its grid, rounded up)
BOUND = {"f32": 0.0, "bf16": 2.0 ** -8, "f16": 2.0 ** -10, "q8_0": 1 / 127, "q5_1": 1 / 15, "q5_0": 1 / 15,
         "q4_1": 1 / 7, "q4_0": 1 / 7}


@pytest.mark.parametrize("qtype", REQUANTIZE_TYPES)
def test_every_re_quantize_type_reads_back_within_its_grid(quantized, tmp_path, qtype):
    art = quantized("w4_auto")
    result = _export(art, tmp_path, allow_requantize=qtype)
    ours, theirs = artifact_weights(art), gguf_weights(result.path, _config(art))
    assert len(result.requantized) == 2
    for t in result.requantized:
        written, w = theirs[t.name]
        assert written == t.qtype == qtype.upper()
        assert np.abs(w - ours[t.name]).max() <= BOUND[qtype] * np.abs(ours[t.name]).max()


def test_fp32_scales_keep_their_codes_when_re_quantized_to_their_own_type(quantized, tmp_path):
    from llmopt.stages.compressed import decompress_linear, parse_schemes
    from llmopt.stages.safetensors_io import load_dir

    art = quantized("w4_fp32")
    result = _export(art, tmp_path, allow_requantize="q4_0")
    assert len(result.requantized) == 14 and all(t.keep_codes for t in result.requantized)
    state = load_dir(art, ["model.safetensors"])
    name = "model.layers.1.mlp.up_proj"
    scheme = parse_schemes(_config(art)["quantization_config"], [name])[name]
    q, scale, _ = decompress_linear(state, name, scheme)
    expect = (q.float().view(q.shape[0], -1, 32) * scale.half().float()[..., None]).view(q.shape)  # [R, G, 32]
    assert np.array_equal(gguf_weights(result.path, _config(art))[f"{name}.weight"][1], expect.numpy())


def test_output_path_rules(quantized, tmp_path):
    art = quantized("w8_bf16")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ArtifactError, match="not a GGUF file"):
        run_export(str(art), tmp_path / "notes.txt", ExportConfig(), force=True)
    with pytest.raises(ArtifactError, match="is a directory"):
        run_export(str(art), tmp_path, ExportConfig())
    first = _export(art, tmp_path)
    with pytest.raises(ArtifactError, match="pass --force"):
        _export(art, tmp_path)
    assert run_export(str(art), first.path, ExportConfig(), force=True).bytes == first.bytes
    assert (tmp_path / "notes.txt").read_text() == "mine" and _leftovers(tmp_path) == []


def test_a_failure_while_writing_leaves_nothing(quantized, tmp_path, monkeypatch):
    from llmopt.stages.export import run as export_run

    calls = []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    real = export_run.tensor_data
    monkeypatch.setattr(export_run, "tensor_data", failing)
    with pytest.raises(KeyboardInterrupt):
        _export(quantized("w8_bf16"), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_dense_artifact_exports_as_stored(tiny_sources, tmp_path):
    result = run_export(str(tiny_sources / "tied"), tmp_path / "dense.gguf", ExportConfig())
    assert result.counts() == {"dense": {"F32": 20}} and result.file_type == "ALL_F32"
    assert result.lineage == []  # a Hugging Face directory, not an artifact


def test_load_gguf_reads_the_file_once_and_loads_what_transformers_loads(quantized, tmp_path, monkeypatch):
    """`load_gguf` (an alias's or a GGUF file's import) opens the file once where transformers alone opens it for
    its config, its tokenizer and its weights, builds one tensor-name map, loads the same weights and tokenizer,
    and puts transformers' and gguf's names back, after an error too."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    from llmopt.stages import model_io

    path = _export(quantized("w4_bf16"), tmp_path).path
    opened, maps = [], []
    open_reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: opened.append(a) or open_reader(*a, **k))
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda *a: maps.append(a) or name_map(*a))
    names = (gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tok = model_io.load_gguf(path)
        assert len(opened) == 1 and len(maps) == 1
        assert (gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint) == names
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
        assert len(opened) > 2 and len(maps) > 2  # transformers alone: once per caller, a map per module
        their_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    mine, other = model.state_dict(), theirs.state_dict()
    assert set(mine) == set(other) and all(torch.equal(mine[k], other[k]) for k in mine)
    assert model.config.to_dict() == theirs.config.to_dict()
    text = "the quick brown fox, 42 jumps <eos> over"
    assert tok(text).input_ids == their_tok(text).input_ids
    with pytest.raises(RuntimeError, match="inside"):
        with model_io.one_gguf_parse():
            raise RuntimeError("inside")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint) == names


def test_processes_importing_one_gguf_at_once_import_it_once(quantized, tmp_path, monkeypatch):
    """Two imports of the same GGUF at once (here threads: each takes the lock through its own descriptor, as
    processes do): the first dequantizes, the second waits for it and opens its import."""
    import threading
    import time

    from llmopt.stages import model_io, source

    path = _export(quantized("w4_bf16"), tmp_path).path
    monkeypatch.setenv("LLMOPT_CACHE_DIR", str(tmp_path / "cache"))
    real, calls = model_io.load_gguf, []

    def load_gguf(p):  # the first call waits up to 2 s for a second one: only the lock keeps it away
        calls.append(p)
        deadline = time.monotonic() + 2
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        return real(p)

    monkeypatch.setattr(model_io, "load_gguf", load_gguf)
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        threads = [threading.Thread(target=lambda: results.append(source.as_artifact(source.resolve(str(path)))))
                   for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert len(calls) == 1 and len(results) == 2
    assert results[0].path == results[1].path and results[0].content_hash == results[1].content_hash


def test_metrics_stored_through_two_handles_are_both_kept(quantized, tmp_path):
    """Two processes' handles on one artifact (each opened before the other stored): each stores its own metric,
    and neither write drops the other's."""
    import shutil

    from llmopt.stages.artifact import Artifact

    art = shutil.copytree(quantized("w4_bf16"), tmp_path / "copy")
    first, second = Artifact.open(art), Artifact.open(art)
    first.update_metrics("eval/a", {"perplexity": 1.5})
    second.update_metrics("eval/b", {"perplexity": 2.5})
    metrics = Artifact.open(art).manifest["metrics"]
    assert metrics["eval/a"] == {"perplexity": 1.5} and metrics["eval/b"] == {"perplexity": 2.5}
    assert second.manifest["metrics"]["eval/a"] == {"perplexity": 1.5}  # the handle sees what it wrote over
