"""Dispatch by device, explicit overrides, cheap import, interpreter regardless of import order."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from llmopt.kernels import KernelBackendError, rms_norm
from llmopt.kernels._backend import pick_backend
from tests.kernels.helpers import requires_triton


def test_device_picks_the_backend():
    assert pick_backend(torch.zeros(1), None) == "torch"
    assert pick_backend(torch.zeros(1), "torch") == "torch"
    if torch.cuda.is_available():
        assert pick_backend(torch.zeros(1, device="cuda"), None) == "triton"


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(KernelBackendError, match="unknown kernel backend 'cuda'"):
        rms_norm(torch.ones(2, 4), torch.ones(4), backend="cuda")


@requires_triton
def test_fresh_process_imports_cheaply_and_interprets_after_plain_triton_import():
    """`import llmopt.kernels` loads neither torch nor triton; and a process that imported
    triton *without* TRITON_INTERPRET (as other tests may) still runs kernels on CPU tensors."""
    script = textwrap.dedent("""
        import sys
        import llmopt.kernels as K
        assert "torch" not in sys.modules and "triton" not in sys.modules, "import is not lazy"
        import triton, torch
        x, w = torch.randn(3, 40), torch.rand(40)
        torch.testing.assert_close(K.rms_norm(x, w, backend="triton"), K.rms_norm(x, w, backend="torch"))
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
