import pytest

from llmopt.stages.errors import SourceError
from llmopt.stages.source import ALIASES, resolve


def test_missing_path_names_known_aliases(tmp_path):
    with pytest.raises(SourceError, match="no such file or directory.*smollm2-135m"):
        resolve(str(tmp_path / "nope"))


def test_unknown_alias():
    with pytest.raises(SourceError, match="not a built-in alias"):
        resolve("smollm9-1t")


def test_non_gguf_file_is_refused(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(SourceError, match="must be a .gguf"):
        resolve(str(f))


def test_corrupted_gguf_is_refused(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"NOPE" + b"\0" * 12)
    with pytest.raises(SourceError, match="not a GGUF file"):
        resolve(str(f))


def test_directory_without_model(tmp_path):
    with pytest.raises(SourceError, match="neither llmopt.json nor config.json"):
        resolve(str(tmp_path))


def test_kinds(tiny_hf):
    assert resolve(str(tiny_hf[0])).kind == "hf"
    assert "smollm2-135m" in ALIASES
