import os

import pytest


@pytest.fixture(scope="session")
def smollm_cache(tmp_path_factory, worker_id):
    """A fresh import cache for the run: each GGUF is dequantized once, then read as an artifact. The pytest-xdist
    workers of one run share it (the folder beside their own temporary folders): the import cache's lock makes the
    second worker wait for the first's import instead of dequantizing the file again."""
    if worker_id == "master":  # one process
        path = tmp_path_factory.mktemp("llmopt-cache")
    else:
        path = tmp_path_factory.getbasetemp().parent / "llmopt-cache"
        path.mkdir(exist_ok=True)
    old = os.environ.get("LLMOPT_CACHE_DIR")
    os.environ["LLMOPT_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("LLMOPT_CACHE_DIR", None)
    else:
        os.environ["LLMOPT_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def smollm_bf16(smollm_cache, tmp_path_factory):
    """`llmopt import smollm2-135m --dtype bf16`, through the CLI entry point."""
    from llmopt.cli.main import main

    out = tmp_path_factory.mktemp("smollm") / "bf16"
    assert main(["import", "smollm2-135m", "-o", str(out), "--dtype", "bf16", "--json"]) == 0
    return out
