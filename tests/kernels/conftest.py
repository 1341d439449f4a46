"""Kernel tests run every Triton kernel on every available device, interpreted and compiled never in one process.

On a machine without CUDA, Triton can only run interpreted. We set TRITON_INTERPRET=1 here
(setdefault: a caller's choice wins) before these tests import triton; if another test module
already imported triton without it, `llmopt.kernels._backend` still runs CPU launches through
the interpreter (see `_interpreter_compat`), so the result does not depend on test order.

With CUDA, this process runs only the CUDA cases (compiled launches: the cuda `device_dtype` cases, and tests
that say "cuda" in their name); every other test of this folder is deselected here and run by
`test_compile.py::test_interpreted_cases_in_their_own_process` in a subprocess with TRITON_INTERPRET=1 and CUDA
hidden (see `helpers.runs_in_this_process`).
"""
import os
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.kernels.helpers import device_dtypes, runs_in_this_process  # noqa: E402  (after the environment is set)

HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line("markers", "with_cuda_cases: a kernel test that runs beside the CUDA cases (compiled)")


def pytest_generate_tests(metafunc):
    if "device_dtype" in metafunc.fixturenames:
        pairs = device_dtypes()
        metafunc.parametrize("device_dtype", pairs, ids=[f"{d}-{str(t).split('.')[-1]}" for d, t in pairs])


def pytest_collection_modifyitems(config, items):
    # Called with the whole session's items: only this folder's are ours to split.
    ours = [item for item in items if HERE in Path(str(item.path)).resolve().parents]
    elsewhere = [item for item in ours if not runs_in_this_process(item, CUDA)]
    if elsewhere:
        skip = set(map(id, elsewhere))
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = [item for item in items if id(item) not in skip]
