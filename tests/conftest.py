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


def pytest_collection_modifyitems(config, items):
    """Interpreted and compiled Triton launches never share a process (`llmopt.kernels._backend` refuses the
    second kind). Where CUDA is present the compiled ones run here, so tests that interpret kernels on CPU tensors
    (marked `interpreted_triton`) are skipped; they run on every machine without CUDA (CI). tests/kernels runs
    its interpreted cases in a CUDA-hidden subprocess instead (tests/kernels/helpers.runs_in_this_process)."""
    import torch

    if not torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="interprets Triton on CPU tensors: cannot share a process with CUDA launches")
    for item in items:
        if item.get_closest_marker("interpreted_triton") is not None:
            item.add_marker(skip)
