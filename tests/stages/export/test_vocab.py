"""Where tokenizer.ggml.pre comes from, and reading string keys from a GGUF without parsing its arrays."""
import gguf
import pytest

from llmopt.stages.export.gguf_meta import gguf_strings, source_strings
from llmopt.stages.export.vocab import pre_tokenizer

BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}


def _gguf(path, pre="smollm", model="gpt2"):
    w = gguf.GGUFWriter(path, "llama")
    w.add_token_list(["a", "b", "<|x|>"])  # string and number arrays before the keys asked for
    w.add_token_types([1, 1, 3])
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_name("Tiny")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


@pytest.mark.parametrize("pre, name", [
    (BYTE_LEVEL, "gpt2"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, BYTE_LEVEL]}, "smollm"),
])
def test_the_name_read_off_tokenizer_json(pre, name):
    assert pre_tokenizer({"pre_tokenizer": pre}, None, {}) == (name, "tokenizer.json")


def test_a_split_regex_transformers_knows_by_name():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    llama3 = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"]}, "behavior": "Isolated"},
        {**BYTE_LEVEL, "use_regex": False}]}
    assert pre_tokenizer({"pre_tokenizer": llama3}, None, {}) == ("llama3", "tokenizer.json")


def test_an_unknown_shape_is_default_and_says_it_guessed():
    split = {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "x"}},
                                                   {**BYTE_LEVEL, "use_regex": False}]}
    assert pre_tokenizer({"pre_tokenizer": split}, None, {}) == ("default", "a guess")
    assert pre_tokenizer({"pre_tokenizer": split}, "llama-bpe", {}) == ("llama-bpe", "--tokenizer-pre")


def test_the_source_gguf_s_own_name_wins_while_the_file_is_unchanged(tmp_path):
    path = _gguf(tmp_path / "src.gguf")
    source = {"kind": "gguf", "path": str(path), "bytes": path.stat().st_size}
    assert pre_tokenizer({"pre_tokenizer": BYTE_LEVEL}, None, source) == ("smollm", "the source GGUF")
    assert pre_tokenizer({"pre_tokenizer": BYTE_LEVEL}, None, {**source, "bytes": 1})[0] == "gpt2"
    assert pre_tokenizer({"pre_tokenizer": BYTE_LEVEL}, None, {**source, "kind": "hf"})[0] == "gpt2"
    spm = _gguf(tmp_path / "spm.gguf", pre="default", model="llama")  # not a byte-level BPE: not taken
    assert pre_tokenizer({"pre_tokenizer": BYTE_LEVEL}, None, {"kind": "gguf", "path": str(spm)})[0] == "gpt2"


def test_gguf_strings_skips_arrays_and_leaves_out_missing_keys(tmp_path):
    path = _gguf(tmp_path / "m.gguf")
    keys = ("general.name", "tokenizer.ggml.pre", "general.license")
    assert gguf_strings(path, keys) == {"general.name": "Tiny", "tokenizer.ggml.pre": "smollm"}
    assert source_strings({"kind": "alias", "path": str(tmp_path / "gone.gguf")}, keys) == {}
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")  # truncated
    assert source_strings({"kind": "gguf", "path": str(tmp_path / "bad.gguf")}, keys) == {}
