import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Output is laid out as in a log (cli/ui.py: no width, nothing cut), whoever runs the suite: pytest-xdist's workers
# get COLUMNS=80 from it, and a caller's COLUMNS would wrap the tables the CLI tests read. Tests that want a width
# pass one to their subprocess.
os.environ.pop("COLUMNS", None)
os.environ.pop("TERMINAL_WIDTH", None)


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


def integration_files_first(items) -> None:
    """Reorder `items` in place: the files that hold an integration test (the embedded models, servers, the README's
    quickstart: minutes each) before the rest, each file's tests kept together and in order. `make test` runs files
    on two workers (pytest-xdist --dist loadfile), which are handed files in this order: the long files go out before
    the ~2,000 short tests, which then fill in beside them, instead of a long file coming last and running alone."""
    def file_of(item):
        return item.nodeid.split("::", 1)[0]

    slow = {file_of(item) for item in items if item.get_closest_marker("integration") is not None}
    items.sort(key=lambda item: file_of(item) not in slow)  # stable: collection order within each group


def pytest_collection_modifyitems(config, items):
    """Integration files first (integration_files_first).

    Interpreted and compiled Triton launches never share a process (`llmopt.kernels._backend` refuses the
    second kind). Where CUDA is present the compiled ones run here, so tests that interpret kernels on CPU tensors
    (marked `interpreted_triton`) are skipped; they run on every machine without CUDA (CI). tests/kernels runs
    its interpreted cases in a CUDA-hidden subprocess instead (tests/kernels/helpers.runs_in_this_process)."""
    import torch

    integration_files_first(items)
    if not torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="interprets Triton on CPU tensors: cannot share a process with CUDA launches")
    for item in items:
        if item.get_closest_marker("interpreted_triton") is not None:
            item.add_marker(skip)
