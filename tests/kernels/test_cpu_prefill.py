"""The native prefill kernels of weight-only layers (csrc/dequant.c, csrc/amx_wq.c through `cpu_prefill`): the
dequantized weight bit for bit against the exact twin's, the matmuls against fp64, and the route each row count
takes in the CPU backends."""
import dataclasses

import pytest
import torch

from llmopt.kernels import cpu_native, cpu_prefill, cpu_quant, select_backend
from llmopt.kernels.wq_matmul import dequantize, w4a16_dequantize
from tests.kernels.helpers import kernel_names, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(not cpu_prefill.prefill_available(),
                                reason="prefill kernels need a C compiler, AVX-512 BF16 and oneDNN")
# bf16 activations and weights, fp32 sums, one rounding: the relative error of a whole output vs the fp64 product
# of the same rounded operands stays ~1e-3 (bf16 output) / ~1e-6 (fp32 output); vs unrounded x, ~4e-3.
REL_ERR = {torch.float32: 1e-2, torch.bfloat16: 1.2e-2}


def _rel_err(y, y64):
    return ((y.double() - y64).norm() / y64.norm()).item()


def _w4(n, k, group, symmetric, seed=0):
    t = quantize_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), group, symmetric)
    weight = cpu_prefill.pack_w4a16_prefill(t["weight_packed"], t["weight_scale"], k, t.get("weight_zero_point"),
                                            group)
    dense = w4a16_dequantize(t["weight_packed"], t["weight_scale"], k, t.get("weight_zero_point"), group)
    return t, weight, dense  # dense: the exact twin's fp32 weight


def _w8(n, k, group, symmetric, seed=0):
    t = quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), symmetric)
    if group is not None:  # the same values, stored group-wise
        t = t | {"weight_scale": t["weight_scale"].repeat(1, k // group)}
        if not symmetric:
            t["weight_zero_point"] = t["weight_zero_point"].repeat(1, k // group)
    weight = cpu_prefill.pack_w8a16_prefill(t["weight"], t["weight_scale"], t.get("weight_zero_point"), group)
    dense = dequantize(t["weight"], t["weight_scale"], t.get("weight_zero_point"), group)
    return t, weight, dense


W4_CASES = [(64, 128, 32, True), (37, 96, 32, False), (96, 576, 64, True), (50, 256, None, False),
            (33, 512, 128, False), (64, 1536, 128, True)]
W8_CASES = [(40, 64, None, True), (37, 96, 16, False), (96, 576, 64, True), (33, 256, 128, False)]


@pytest.mark.parametrize("n, k, group, symmetric", W4_CASES)
def test_w4_dequantized_rows_are_the_twins_weight_rounded_once(n, k, group, symmetric):
    _, weight, dense = _w4(n, k, group, symmetric)
    out = torch.empty(n, k, dtype=torch.bfloat16)
    assert torch.equal(weight.dequantize_rows(0, n, out), dense.to(torch.bfloat16))
    part = torch.empty(7, k, dtype=torch.bfloat16)
    assert torch.equal(weight.dequantize_rows(5, 12, part), dense[5:12].to(torch.bfloat16))


@pytest.mark.parametrize("n, k, group, symmetric", W8_CASES)
def test_w8_dequantized_rows_are_the_twins_weight_rounded_once(n, k, group, symmetric):
    _, weight, dense = _w8(n, k, group, symmetric)
    out = torch.empty(n, k, dtype=torch.bfloat16)
    assert torch.equal(weight.dequantize_rows(0, n, out), dense.to(torch.bfloat16))


def _check_matmul(weight, dense, rows, dtype):
    x = torch.randn(rows, dense.shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
    y = cpu_prefill.prefill_matmul(x, weight)
    assert y.dtype == dtype and y.shape == (rows, dense.shape[0])
    rounded = x.to(torch.bfloat16).double() @ dense.to(torch.bfloat16).double().T  # the operands the kernel sees
    # AMX writes fp32 sums as they are; oneDNN's bf16 GEMM (the scratch route) rounds them to bf16 first
    fp32_out = dtype == torch.float32 and weight.amx is not None
    assert _rel_err(y, rounded) < (1e-5 if fp32_out else 5e-3)
    assert _rel_err(y, x.double() @ dense.double().T) < REL_ERR[dtype]  # the exact twin


@pytest.mark.parametrize("n, k, group, symmetric", W4_CASES)
@pytest.mark.parametrize("rows", [1, 5, 33, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4_matmul_on_each_route_matches_the_twin(n, k, group, symmetric, rows, dtype):
    _, weight, dense = _w4(n, k, group, symmetric)
    assert (weight.amx is not None) == (n % 32 == 0 and cpu_prefill.amx_available())
    _check_matmul(weight, dense, rows, dtype)
    _check_matmul(dataclasses.replace(weight, amx=None), dense, rows, dtype)  # the scratch route


@pytest.mark.parametrize("n, k, group, symmetric", W8_CASES)
@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8_matmul_on_each_route_matches_the_twin(n, k, group, symmetric, rows, dtype):
    _, weight, dense = _w8(n, k, group, symmetric)
    assert (weight.amx is not None) == (n % 32 == 0 and (group or k) % 32 == 0 and cpu_prefill.amx_available())
    _check_matmul(weight, dense, rows, dtype)
    _check_matmul(dataclasses.replace(weight, amx=None), dense, rows, dtype)


def test_large_weights_go_by_chunks_of_rows(monkeypatch):
    _, weight, dense = _w4(100, 128, 32, False)
    weight = dataclasses.replace(weight, amx=None)
    x = torch.randn(20, 128)
    whole = cpu_prefill.prefill_matmul(x, weight)
    monkeypatch.setattr(cpu_prefill, "PREFILL_CHUNK_ELEMS", 16 * 128)  # 7 chunks, the last of 4 rows
    calls = kernel_names(lambda: cpu_prefill.prefill_matmul(x, weight))
    assert calls.count("llmopt::dequantize_w4") == 7
    assert torch.equal(cpu_prefill.prefill_matmul(x, weight), whole)


def test_layouts_the_kernels_cannot_take_are_declined():
    t = quantize_int4(torch.randn(32, 80), 16, True)  # K and group not multiples of 32
    assert cpu_prefill.pack_w4a16_prefill(t["weight_packed"], t["weight_scale"], 80, None, 16) is None
    t8 = quantize_int8(torch.randn(32, 40))  # K not a multiple of 16
    assert cpu_prefill.pack_w8a16_prefill(t8["weight"], t8["weight_scale"]) is None


def test_bad_output_buffers_are_refused_with_a_message():
    _, weight, _ = _w4(64, 128, 32, True)
    with pytest.raises(ValueError, match="contiguous bf16"):
        weight.dequantize_rows(0, 64, torch.empty(64, 128))
    with pytest.raises(ValueError, match="rows 60..70"):
        weight.dequantize_rows(60, 70, torch.empty(10, 128, dtype=torch.bfloat16))


ROUTE_CASES = {  # format, tensors, group, [(rows, first kernel)] on cpu-native
    # on AMX, W4 goes from the GEMV straight to the AMX kernel (torch's int4 layout is not made)
    "w4-int4pack": ("w4a16", lambda: quantize_int4(torch.randn(64, 128), 32, False), 32,
                    "aten::_weight_int4pack_mm_for_cpu", None if cpu_prefill.amx_available()
                    else cpu_quant.PREFILL_MIN_ROWS_W4),
    "w4-n36-no-int4pack": ("w4a16", lambda: quantize_int4(torch.randn(36, 128), 32, True), 32, None, None),
    "w8-int8pack": ("w8a16", lambda: quantize_int8(torch.randn(64, 128)), None, "aten::_weight_int8pack_mm",
                    cpu_quant.PREFILL_MIN_ROWS_W8),
    "w8-group": ("w8a16", lambda: _w8(64, 128, 32, True)[0], 32, None, None),
}


@pytest.mark.skipif(not cpu_native.gemv_available(), reason="native GEMV needs a C compiler and AVX-512")
@pytest.mark.parametrize("case", ROUTE_CASES)
def test_native_backend_routes_prefill_rows_to_the_prefill_kernels(case):
    # the GEMV up to its rows; then torch's packed kernel where one takes the layout (W4: unless on AMX), up to
    # the prefill kernels' rows; then the prefill kernel: AMX for W4 with N % 32 == 0, else dequantize + oneDNN. No dense copy.
    fmt, make, group, packed_kernel, first_prefill_row = ROUTE_CASES[case]
    t = make()
    layer = select_backend("cpu-native").quantized_linear(fmt, t, group)
    assert layer.dense is None
    most = layer.native.max_rows
    first_prefill_row = first_prefill_row or most + 1
    n = layer.out_features
    prefill = [f"llmopt::amx_w{fmt[1]}_matmul"] if n % 32 == 0 and (group or 128) % 32 == 0 \
        and cpu_prefill.amx_available() else [f"llmopt::dequantize_w{fmt[1]}", "mkldnn::_linear_pointwise"]
    reference = select_backend("reference").quantized_linear(fmt, t, group)
    for rows in sorted({1, most, most + 1, first_prefill_row - 1, first_prefill_row, 37}):
        x = torch.randn(rows, 128)
        if rows <= most:
            expected = [f"llmopt::gemv_w{fmt[1]}"]
        elif rows < first_prefill_row:
            expected = [packed_kernel]
        else:
            expected = prefill
        assert kernel_names(lambda: layer(x)) == expected, rows
        assert _rel_err(layer(x), reference(x).double()) < 1e-2


def test_torch_backend_routes_prefill_rows_to_the_prefill_kernels():
    t = quantize_int4(torch.randn(64, 128), 32, True)
    layer = select_backend("cpu-torch").quantized_linear("w4a16", t, 32)
    rows = cpu_quant.PREFILL_MIN_ROWS_W4
    prefill = "llmopt::amx_w4_matmul" if cpu_prefill.amx_available() else "llmopt::dequantize_w4"
    assert kernel_names(lambda: layer(torch.randn(rows - 1, 128))) == ["aten::_weight_int4pack_mm_for_cpu"]
    assert kernel_names(lambda: layer(torch.randn(rows, 128)))[0] == prefill
