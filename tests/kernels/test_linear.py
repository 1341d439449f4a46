"""Quantized nn.Modules: CPU fast paths chosen at load, accuracy vs fp64, fallbacks, bias."""
import pytest
import torch

from llmopt.kernels import W4A16Linear, W8A8Linear, W8A16Linear, w4a16_dequantize
from llmopt.kernels.cpu_quant import Int4CpuWeight, Int8CpuWeight, Int8DynamicCpuWeight, fbgemm_available
from tests.kernels.helpers import quantize_int4, quantize_int8

# The CPU kernels run on bf16 activations (and bf16 scales for int4): relative error vs the
# fp64 product of the same quantized weight stays below ~0.5%, far under the int4/int8 weight
# rounding itself (several % / ~0.5%).
CPU_REL_ERR = 1e-2


def _rel_err(y, y64):
    return ((y.double() - y64).norm() / y64.norm()).item()


@pytest.mark.parametrize("k, n, group_size, symmetric", [(576, 64, 64, True), (256, 48, 128, False),
                                                         (192, 32, None, True), (96, 32, 32, False)])
def test_w4a16_linear_uses_int4_cpu_kernel(k, n, group_size, symmetric):
    t = quantize_int4(torch.randn(n, k), group_size, symmetric)
    bias = torch.randn(n)
    layer = W4A16Linear.from_compressed(t, group_size=group_size, bias=bias)
    assert isinstance(layer.cpu_weight, Int4CpuWeight)
    x = torch.randn(3, 2, k)
    w = w4a16_dequantize(t["weight_packed"], t["weight_scale"], k, t.get("weight_zero_point"), group_size,
                         torch.float64)
    y64 = x.double() @ w.t() + bias.double()
    y = layer(x)
    assert y.shape == (3, 2, n) and y.dtype == torch.float32
    assert _rel_err(y, y64) < CPU_REL_ERR
    layer.backend = "torch"
    assert _rel_err(layer(x), y64) < 1e-6


@pytest.mark.parametrize("k, n", [(100, 24), (64, 17)])  # K % 8 != 0 / N % 16 != 0
def test_w4a16_linear_falls_back_to_reference(k, n):
    t = quantize_int4(torch.randn(n, k), 32 if k % 32 == 0 else None, True)
    layer = W4A16Linear.from_compressed(t, group_size=32 if k % 32 == 0 else None)
    assert layer.cpu_weight is None
    x = torch.randn(5, k)
    torch.testing.assert_close(layer(x), layer.to(torch.float32).forward(x))
    assert "reference" in repr(layer)


@pytest.mark.parametrize("k, n, symmetric, kernel", [(576, 40, True, True), (128, 16, False, True),
                                                     (96, 16, True, False)])  # K % 64 != 0: reference
def test_w8a16_linear(k, n, symmetric, kernel):
    t = quantize_int8(torch.randn(n, k), symmetric)
    layer = W8A16Linear.from_compressed(t)
    assert isinstance(layer.cpu_weight, Int8CpuWeight) == kernel
    x = torch.randn(4, k)
    zero = t.get("weight_zero_point", torch.zeros(1)).double()
    y64 = x.double() @ ((t["weight"].double() - zero) * t["weight_scale"].double()).t()
    assert _rel_err(layer(x), y64) < (CPU_REL_ERR if kernel else 1e-6)


@pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm (non-x86 torch build)")
def test_w8a8_linear_fbgemm_is_per_token():
    k, n = 576, 64
    t = quantize_int8(torch.randn(n, k))
    layer = W8A8Linear.from_compressed(t)
    assert isinstance(layer.cpu_weight, Int8DynamicCpuWeight)
    x = torch.randn(6, k) * torch.logspace(-3, 3, 6)[:, None]  # tokens of very different magnitude
    y64 = x.double() @ (t["weight"].double() * t["weight_scale"].double()).t()
    y = layer(x)
    ref = W8A8Linear.from_compressed(t, backend="torch")(x)
    for row in range(6):  # every token keeps int8 precision, as with per-token quantization
        assert _rel_err(y[row], y64[row]) < 2 * max(_rel_err(ref[row], y64[row]), 2e-3)
    alone = layer(x[:1])  # the same token alone keeps the same precision
    assert _rel_err(alone[0], y64[0]) < 2 * max(_rel_err(ref[0], y64[0]), 2e-3)


def test_w8a8_rejects_asymmetric():
    with pytest.raises(ValueError, match="asymmetric"):
        W8A8Linear.from_compressed(quantize_int8(torch.randn(16, 64), symmetric=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_modules_on_cuda_run_triton(dtype):
    k, n = 256, 64
    w = torch.randn(n, k)
    x = torch.randn(5, k, device="cuda", dtype=dtype)
    layers = [W4A16Linear.from_compressed(quantize_int4(w, 64, False), group_size=64),
              W8A16Linear.from_compressed(quantize_int8(w)), W8A8Linear.from_compressed(quantize_int8(w))]
    for layer in layers:
        expected = layer(x.float().cpu()).double()
        y = layer.cuda()(x)
        assert y.dtype == dtype and y.is_cuda
        assert _rel_err(y.cpu(), expected) < 2e-2


@pytest.mark.parametrize("group_size, symmetric", [(64, True), (None, False), (128, False)])
def test_large_batches_use_a_transient_bf16_weight(monkeypatch, group_size, symmetric):
    from llmopt.kernels import cpu_quant

    k, n = 320, 32  # group 128: 320 % 128 != 0 takes the general dequantization, the others the grouped one
    t4, t8 = quantize_int4(torch.randn(n, k), group_size, symmetric), quantize_int8(torch.randn(n, k), symmetric)
    pairs = [(W4A16Linear.from_compressed(t4, group_size=group_size),
              W4A16Linear.from_compressed(t4, group_size=group_size, backend="torch")),
             (W8A16Linear.from_compressed(t8), W8A16Linear.from_compressed(t8, backend="torch"))]
    x = torch.randn(5, k)
    kernel_out = [layer(x) for layer, _ in pairs]
    monkeypatch.setattr(cpu_quant, "DEQUANT_MIN_ROWS_W4", 2)
    monkeypatch.setattr(cpu_quant, "DEQUANT_MIN_ROWS_W8", 2)
    for (layer, reference), y_kernel in zip(pairs, kernel_out):
        assert layer.cpu_weight is not None
        y = layer(x)
        assert _rel_err(y, reference(x).double()) < CPU_REL_ERR
        assert _rel_err(y, y_kernel.double()) < CPU_REL_ERR
