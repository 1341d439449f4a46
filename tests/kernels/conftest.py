"""Kernel tests run every Triton kernel on every available device.

On a machine without CUDA, Triton can only run interpreted. We set TRITON_INTERPRET=1 here
(setdefault: a caller's choice wins) before these tests import triton; if another test module
already imported triton without it, `llmopt.kernels._backend` still runs CPU launches through
the interpreter (see `_interpretable_stdlib`), so the result does not depend on test order.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.kernels.helpers import device_dtypes  # noqa: E402  (after the environment is set)


def pytest_generate_tests(metafunc):
    if "device_dtype" in metafunc.fixturenames:
        pairs = device_dtypes()
        metafunc.parametrize("device_dtype", pairs, ids=[f"{d}-{str(t).split('.')[-1]}" for d, t in pairs])
