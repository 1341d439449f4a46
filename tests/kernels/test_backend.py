"""Backends chosen once by name and device; per-op dispatch by device and explicit overrides; cheap import;
the interpreter regardless of import order."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from llmopt.kernels import BACKENDS, KernelBackendError, cpu_native, rms_norm, rms_norm_ref, select_backend
from llmopt.kernels.cpu_backends import CpuNativeBackend, CpuTorchBackend
from llmopt.kernels.op_backends import ReferenceBackend, TritonBackend
from tests.kernels.helpers import HAS_TRITON, assert_close, requires_triton


def test_op_default_on_cpu_tensors_is_the_torch_twin():
    x, w, r = torch.randn(3, 40), torch.rand(40), torch.randn(3, 40)
    assert torch.equal(rms_norm(x, w), rms_norm_ref(x, w, 1e-6))
    assert torch.equal(rms_norm(x, w, backend="torch"), rms_norm_ref(x, w, 1e-6))
    out, res = rms_norm(x, w, residual=r.clone())
    assert torch.equal(out, rms_norm_ref(x, w, 1e-6, r)[0]) and torch.equal(res, x + r)
    if torch.cuda.is_available():  # CUDA tensors: the Triton kernel
        xc, wc = x.cuda(), w.cuda()
        assert torch.equal(rms_norm(xc, wc), rms_norm(xc, wc, backend="triton"))


def test_unknown_op_backend_is_a_clear_error():
    with pytest.raises(KernelBackendError, match="unknown kernel backend 'cuda'"):
        rms_norm(torch.ones(2, 4), torch.ones(4), backend="cuda")


def test_auto_picks_by_device_and_dtype():
    native = cpu_native.gemv_available()
    assert type(select_backend()) is (CpuNativeBackend if native else CpuTorchBackend)
    assert type(select_backend("auto", "cpu", torch.bfloat16)) is type(select_backend())
    assert type(select_backend("auto", "cpu", torch.float16)) is CpuTorchBackend  # no native fp16 kernels
    cuda = TritonBackend if HAS_TRITON else ReferenceBackend  # a device, not a live GPU: nothing runs yet
    assert type(select_backend("auto", "cuda")) is cuda


@requires_triton
def test_every_name_builds_where_it_runs():
    assert BACKENDS == ("auto", "cpu-native", "cpu-torch", "triton", "reference")
    for name in BACKENDS[2:]:
        backend = select_backend(name)
        assert backend.name == name and backend.device == torch.device("cpu")
    assert type(select_backend("reference", "cuda:1")) is ReferenceBackend
    assert select_backend("triton", "cuda").device == torch.device("cuda")


def test_names_that_cannot_run_here_say_why_in_one_line():
    with pytest.raises(KernelBackendError, match=r"^unknown backend 'gpu'; use one of auto, cpu-native, "):
        select_backend("gpu")
    for name in ("cpu-torch", "cpu-native"):
        with pytest.raises(KernelBackendError, match=f"^{name}: runs on CPU only, not on cuda"):
            select_backend(name, "cuda")
    if cpu_native.gemv_available():
        with pytest.raises(KernelBackendError, match="^cpu-native: native kernels take fp32 or bf16, not float16"):
            select_backend("cpu-native", "cpu", torch.float16)


BACKEND_CLASSES = (CpuTorchBackend, CpuNativeBackend, ReferenceBackend, TritonBackend)


def test_every_backend_has_the_protocols_ops_with_its_signature():
    """The Backend protocol's ops with their parameters and defaults (window=None) on every backend class."""
    import inspect

    from llmopt.kernels.backend import Backend

    for op in ("silu_and_mul", "gelu_tanh_and_mul", "attention"):
        expected = inspect.signature(getattr(Backend, op))
        for cls in BACKEND_CLASSES:
            got = inspect.signature(getattr(cls, op))
            assert [(p.name, p.default) for p in got.parameters.values()] == \
                   [(p.name, p.default) for p in expected.parameters.values()], (cls.__name__, op)


GELU_CASES = [("cpu-torch", torch.float32), ("cpu-torch", torch.bfloat16), ("cpu-native", torch.float32),
              ("cpu-native", torch.bfloat16), ("reference", torch.float32), ("triton", torch.float32)]


@pytest.mark.parametrize("name, dtype", GELU_CASES, ids=[f"{n}-{str(t)[6:]}" for n, t in GELU_CASES])
def test_every_backend_runs_gelu_tanh_and_mul(name, dtype):
    if name == "cpu-native" and not cpu_native.gemv_available() or name == "triton" and not HAS_TRITON:
        pytest.skip(f"{name} cannot run here")
    x = (torch.randn(5, 2 * 48, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    out = select_backend(name, "cpu", dtype).gelu_tanh_and_mul(x)
    gate, up = x.double().chunk(2, -1)
    expected = gate * torch.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate ** 3)) * up  # g sigmoid(2u) = gelu
    assert out.dtype == dtype and out.shape == (5, 48)
    assert_close(out, expected, dtype)


def test_cpu_backends_take_their_tuning_as_constructor_arguments():
    backend = CpuTorchBackend(group_overhead_keys=0)
    assert backend.group_overhead_keys == 0 and select_backend("cpu-torch").group_overhead_keys == 384


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


@requires_triton
def test_kernel_modules_import_triton_at_the_first_launch_only():
    """Importing every kernel module (as `llmopt serve` on CPU does) leaves triton unimported. The first launch
    imports it and gives the kernels' modules Triton's names: in a fresh process, a kernel that calls helpers of
    another module (wq_matmul's, wq_gemv's) runs right."""
    script = textwrap.dedent("""
        import importlib, pkgutil, sys
        import torch
        import llmopt.kernels as K
        for info in pkgutil.iter_modules(K.__path__):
            importlib.import_module(f"llmopt.kernels.{info.name}")
        assert "triton" not in sys.modules, "importing the kernel modules imported triton"
        from llmopt.kernels import wq_gemv, wq_matmul
        x, w = torch.randn(17, 64), torch.randint(-128, 128, (24, 64), dtype=torch.int8)  # 17 rows: not the GEMV
        scale = torch.rand(24, 2) / 100
        torch.testing.assert_close(K.w8a16_matmul(x, w, scale, group_size=32, backend="triton"),
                                   K.w8a16_matmul(x, w, scale, group_size=32, backend="torch"), atol=1e-4, rtol=1e-4)
        import triton.language as tl
        assert wq_matmul.tl is tl and wq_gemv.tl is tl and isinstance(wq_matmul.STEP, tl.constexpr)
        assert wq_matmul.weight_tile is wq_gemv.weight_tile  # one Triton kernel for both modules
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
