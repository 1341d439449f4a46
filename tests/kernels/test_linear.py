"""Linear layers as the backends build them: CPU kernels chosen at load by row count, accuracy vs fp64,
fallbacks, bias; the quantized layers alone run the exact twin."""
import pytest
import torch
import torch.nn.functional as F

from llmopt.kernels import W4A16Linear, W8A8Linear, cpu_native, cpu_prefill, select_backend, w4a16_dequantize, \
    w4a16_matmul
from llmopt.kernels.cpu_linear import DenseLinear
from llmopt.kernels.cpu_quant import Int4CpuWeight, Int8CpuWeight, Int8DynamicCpuWeight, fbgemm_available
from tests.helpers import BF16_ROUTED, needs_avx512_fbgemm
from tests.kernels.helpers import kernel_names, quantize_int4, quantize_int8

# The CPU kernels run on bf16 activations (and bf16 scales for int4): relative error vs the
# fp64 product of the same quantized weight stays below ~0.5%, far under the int4/int8 weight
# rounding itself (several % / ~0.5%).
CPU_REL_ERR = 1e-2
needs_gemv = pytest.mark.skipif(not cpu_native.gemv_available(), reason="native GEMV needs a C compiler and AVX-512")


def _rel_err(y, y64):
    return ((y.double() - y64).norm() / y64.norm()).item()


@pytest.mark.parametrize("k, n, group_size, symmetric", [(576, 64, 64, True), (256, 48, 128, False),
                                                         (192, 32, None, True), (96, 32, 32, False)])
def test_w4a16_linear_uses_int4_cpu_kernel(k, n, group_size, symmetric):
    t = quantize_int4(torch.randn(n, k), group_size, symmetric)
    bias = torch.randn(n)
    layer = select_backend("cpu-torch").quantized_linear("w4a16", t, group_size, bias)
    assert isinstance(layer, W4A16Linear) and isinstance(layer.cpu_weight, Int4CpuWeight)
    x = torch.randn(3, 2, k)
    w = w4a16_dequantize(t["weight_packed"], t["weight_scale"], k, t.get("weight_zero_point"), group_size,
                         torch.float64)
    y64 = x.double() @ w.t() + bias.double()
    assert kernel_names(lambda: layer(x)) == ["aten::_weight_int4pack_mm_for_cpu"]
    y = layer(x)
    assert y.shape == (3, 2, n) and y.dtype == torch.float32
    assert _rel_err(y, y64) < CPU_REL_ERR
    reference = select_backend("reference").quantized_linear("w4a16", t, group_size, bias)
    assert _rel_err(reference(x), y64) < 1e-6


@pytest.mark.parametrize("k, n", [(100, 24), (64, 17)])  # K % 8 != 0 / N % 16 != 0
def test_w4a16_without_a_cpu_kernel_is_dequantized_once(k, n):
    t = quantize_int4(torch.randn(n, k), 32 if k % 32 == 0 else None, True)
    alone = W4A16Linear.from_compressed(t, group_size=32 if k % 32 == 0 else None)
    x = torch.randn(5, k)
    assert alone.cpu_weight is None and "cpu=" not in repr(alone)
    exact = w4a16_matmul(x, t["weight_packed"], t["weight_scale"], group_size=alone.group_size, backend="torch")
    assert torch.equal(alone(x), exact)  # a layer no backend routed: the exact twin
    layer = select_backend("cpu-torch").quantized_linear("w4a16", t, alone.group_size)
    assert isinstance(layer, DenseLinear)  # no int4 CPU kernel: one dense copy, on oneDNN
    torch.testing.assert_close(layer(x), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k, n, symmetric, kernel", [(576, 40, True, True), (128, 16, False, True),
                                                     (96, 16, True, False)])  # K % 64 != 0: a dense copy
def test_w8a16_linear(k, n, symmetric, kernel):
    t = quantize_int8(torch.randn(n, k), symmetric)
    layer = select_backend("cpu-torch").quantized_linear("w8a16", t)
    assert isinstance(getattr(layer, "cpu_weight", None), Int8CpuWeight) == kernel
    assert isinstance(layer, DenseLinear) != kernel
    x = torch.randn(4, k)
    zero = t.get("weight_zero_point", torch.zeros(1)).double()
    y64 = x.double() @ ((t["weight"].double() - zero) * t["weight_scale"].double()).t()
    assert _rel_err(layer(x), y64) < (CPU_REL_ERR if kernel else 1e-6)


@pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm (non-x86 torch build)")
@needs_avx512_fbgemm
def test_w8a8_linear_fbgemm_is_per_token():
    k, n = 576, 64
    t = quantize_int8(torch.randn(n, k))
    layer = select_backend("cpu-torch").quantized_linear("w8a8", t)
    assert isinstance(layer.cpu_weight, Int8DynamicCpuWeight)
    x = torch.randn(6, k) * torch.logspace(-3, 3, 6)[:, None]  # tokens of very different magnitude
    y64 = x.double() @ (t["weight"].double() * t["weight_scale"].double()).t()
    assert kernel_names(lambda: layer(x)) == ["quantized::linear_dynamic"]
    y = layer(x)
    ref = select_backend("reference").quantized_linear("w8a8", t)(x)
    for row in range(6):  # every token keeps int8 precision, as with per-token quantization
        assert _rel_err(y[row], y64[row]) < 2 * max(_rel_err(ref[row], y64[row]), 2e-3)
    alone = layer(x[:1])  # the same token alone keeps the same precision
    assert _rel_err(alone[0], y64[0]) < 2 * max(_rel_err(ref[0], y64[0]), 2e-3)
    native = select_backend("cpu-native").quantized_linear("w8a8", t) if cpu_native.gemv_available() else layer
    assert native.native is None and kernel_names(lambda: native(x[:1])) == ["quantized::linear_dynamic"]


def test_w8a8_rejects_asymmetric():
    with pytest.raises(ValueError, match="asymmetric"):
        W8A8Linear.from_compressed(quantize_int8(torch.randn(16, 64), symmetric=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_modules_on_cuda_run_triton(dtype):
    k, n = 256, 64
    w = torch.randn(n, k)
    x = torch.randn(5, k, device="cuda", dtype=dtype)
    triton = select_backend("triton", "cuda")
    for fmt, t in (("w4a16", quantize_int4(w, 64, False)), ("w8a16", quantize_int8(w)), ("w8a8", quantize_int8(w))):
        expected = select_backend("cpu-torch").quantized_linear(fmt, t)(x.float().cpu()).double()
        y = triton.quantized_linear(fmt, {name: v.cuda() for name, v in t.items()})(x)
        assert y.dtype == dtype and y.is_cuda
        assert _rel_err(y.cpu(), expected) < 2e-2


def test_the_transient_weight_is_bf16_only_where_onednn_multiplies_bf16():
    from llmopt.kernels import cpu_quant

    fast = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # AVX-512 or AVX-NE-CONVERT; not AVX2 alone
    assert cpu_quant.dequant_gemm_dtype() == (torch.bfloat16 if fast else torch.float32)


@pytest.mark.parametrize("gemm_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group_size, symmetric", [(64, True), (None, False), (128, False)])
def test_large_batches_use_a_transient_weight(monkeypatch, group_size, symmetric, gemm_dtype):
    from llmopt.kernels import cpu_quant

    k, n = 320, 32  # group 128: 320 % 128 != 0 takes the general dequantization, the others the grouped one
    t4, t8 = quantize_int4(torch.randn(n, k), group_size, symmetric), quantize_int8(torch.randn(n, k), symmetric)
    cpu, ref = select_backend("cpu-torch"), select_backend("reference")
    pairs = [(cpu.quantized_linear("w4a16", t4, group_size), ref.quantized_linear("w4a16", t4, group_size)),
             (cpu.quantized_linear("w8a16", t8), ref.quantized_linear("w8a16", t8))]
    x = torch.randn(5, k)
    kernel_out = [layer(x) for layer, _ in pairs]
    monkeypatch.setattr(cpu_quant, "DEQUANT_MIN_ROWS_W4", 2)
    monkeypatch.setattr(cpu_quant, "DEQUANT_MIN_ROWS_W8", 2)
    monkeypatch.setattr(cpu_quant, "dequant_gemm_dtype", lambda: gemm_dtype)
    # fp32: the reference's own arithmetic for W4 (x and the dequantized weight in fp32), W8's scales kept in bf16
    # for its int8 kernel (a relative 2^-9 each); bf16: x and the weight rounded too
    bounds = [1e-5, 4e-3] if gemm_dtype == torch.float32 else [CPU_REL_ERR, CPU_REL_ERR]
    for (layer, reference), y_kernel, bound in zip(pairs, kernel_out, bounds):
        assert layer.cpu_weight is not None
        assert kernel_names(lambda: layer(x), ("aten::linear", "aten::_weight_int")) == ["aten::linear"]
        y = layer(x)
        assert y.dtype == x.dtype
        assert _rel_err(y, reference(x).double()) < bound
        assert _rel_err(y, y_kernel.double()) < CPU_REL_ERR


@pytest.mark.parametrize("dtype", [torch.float32, BF16_ROUTED])
def test_dense_routes_by_row_count(dtype):
    # cpu-torch: MKL on W.T for one fp32 row, oneDNN beyond; cpu-native: the GEMV up to GEMV_MAX_ROWS rows
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 40, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)
    torch_cpu = select_backend("cpu-torch").dense_linear(weight, bias)
    one_row = "aten::mm" if dtype == torch.float32 else "mkldnn::_linear_pointwise"
    assert kernel_names(lambda: torch_cpu(torch.randn(1, 40).to(dtype))) == [one_row]
    assert kernel_names(lambda: torch_cpu(torch.randn(2, 40).to(dtype))) == ["mkldnn::_linear_pointwise"]
    if cpu_native.gemv_available():
        native = select_backend("cpu-native").dense_linear(weight.clone(), bias)
        most = cpu_native.GEMV_MAX_ROWS[dtype]
        for rows in range(1, most + 3):
            expected = "llmopt::gemv" if rows <= most else "mkldnn::_linear_pointwise"
            assert kernel_names(lambda: native(torch.randn(rows, 40).to(dtype))) == [expected], rows


def _group_wise_int8(n, k, group):
    t = quantize_int8(torch.randn(n, k))
    return t | {"weight_scale": t["weight_scale"].repeat(1, k // group)}  # [N, K / group]: equal, yet group-wise


NATIVE_CASES = {  # (format, tensors, group size, the kernel just beyond the GEMV's rows)
    # on AMX the prefill kernel takes W4 beyond the GEMV (no torch int4 layout made); elsewhere torch's int4 kernel
    "w4-int4pack": ("w4a16", lambda: quantize_int4(torch.randn(64, 128), 32, False), 32,
                    "llmopt::amx_w4_matmul" if cpu_prefill.amx_available() else "aten::_weight_int4pack_mm_for_cpu"),
    "w4-n36-prefill": ("w4a16", lambda: quantize_int4(torch.randn(36, 128), 32, True), 32,  # N % 16: no int4 kernel
                       "llmopt::dequantize_w4"),
    # W8 beyond the GEMV's 16 rows: torch's int8 route, which hands 16 rows and more to the prefill kernel
    "w8-int8pack": ("w8a16", lambda: quantize_int8(torch.randn(64, 128)), None,
                    "llmopt::amx_w8_matmul" if cpu_prefill.amx_available() else "llmopt::dequantize_w8"),
    "w8-group-prefill": ("w8a16", lambda: _group_wise_int8(64, 128, 32), 32,
                         "llmopt::amx_w8_matmul" if cpu_prefill.amx_available() else "llmopt::dequantize_w8"),
}


@needs_gemv
@pytest.mark.parametrize("case", NATIVE_CASES)
def test_native_quantized_routes_by_row_count(case):
    # the GEMV up to its rows; beyond, W4 on AMX the AMX prefill kernel, else torch's kernel where one takes the
    # layout, else the prefill kernels
    # (tests/kernels/test_cpu_prefill.py follows every row count); never a dense copy
    fmt, make, group, beyond = NATIVE_CASES[case]
    t = make()
    layer = select_backend("cpu-native").quantized_linear(fmt, t, group)
    most = cpu_native.W4_MAX_ROWS if fmt == "w4a16" else cpu_native.W8_MAX_ROWS
    assert layer.native is not None and layer.native.max_rows == most
    assert layer.dense is None
    reference = select_backend("reference").quantized_linear(fmt, t, group)
    for rows in (1, most, most + 1):
        x = torch.randn(rows, 128)
        assert kernel_names(lambda: layer(x))[0] == (f"llmopt::gemv_w{fmt[1]}" if rows <= most else beyond), rows
        tol = 1e-5 if rows <= most else CPU_REL_ERR  # fp32 vs bf16 kernels
        assert _rel_err(layer(x), reference(x).double()) < tol


def test_dense_fallback_keeps_only_onednn_copy():
    # a layer that only takes calls beyond another kernel's rows: the oneDNN copy alone, the loaded weight freed
    import gc
    import weakref

    from llmopt.kernels.cpu_linear import prebuild_row_buckets

    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(48, 40, generator=g), torch.randn(12, 40, generator=g)
    expected, gone = F.linear(x, weight), weakref.ref(weight)
    layer = DenseLinear(weight, None).prepare(False, above_rows=8)
    del weight
    gc.collect()
    assert gone() is None and layer.weight.device.type == "meta" and layer.released == ("weight",)
    assert layer.weight_t is None and layer.native is None and layer.packed is not None
    assert kernel_names(lambda: layer(x)) == ["mkldnn::_linear_pointwise"]
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)

    class Model(torch.nn.Module):  # prebuilt from the ninth row only, and a dense copy inside lm_head: its rows
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Module()
            self.lm_head.dense = layer

    assert prebuild_row_buckets(Model(), max_tokens=512, max_logit_rows=16) == 8  # rows 9..16


@pytest.mark.parametrize("fmt", ["w4a16", "w8a16"])
def test_dequantized_in_row_chunks_equals_the_whole(monkeypatch, fmt):
    # asymmetric, 40 rows in chunks of 16: W4 zero points are packed 8 rows a word, the last chunk is ragged
    from llmopt.kernels import W8A16Linear, cpu_backends
    from llmopt.kernels.wq_matmul import dequantize

    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    if fmt == "w4a16":
        layer = W4A16Linear.from_compressed(quantize_int4(w, 32, False), 32)
        whole = w4a16_dequantize(layer.weight_packed, layer.weight_scale, 64, layer.weight_zero_point, 32)
    else:
        layer = W8A16Linear.from_compressed(quantize_int8(w, symmetric=False))
        whole = dequantize(layer.weight, layer.weight_scale, layer.weight_zero_point, layer.group_size)
    monkeypatch.setattr(cpu_backends, "DEQUANT_ROWS", 16)
    assert torch.equal(cpu_backends.dequantized(layer), whole)
    assert torch.equal(cpu_backends.dequantized(layer, torch.bfloat16), whole.to(torch.bfloat16))
