import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """(directory, model, tokenizer) of a tiny tied Llama saved as a plain HF directory."""
    from tests.helpers import write_hf_dir

    path = tmp_path_factory.mktemp("tiny-hf")
    model, tok = write_hf_dir(path)
    return path, model, tok


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"
