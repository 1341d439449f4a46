"""w4a16 / w8a16 / w8a8: layout against compressed-tensors, Triton vs twin, accuracy vs fp64."""
import pytest
import torch
import torch.nn.functional as F

from llmopt.kernels import quantize_per_token, w4a16_dequantize, w4a16_matmul, w8a8_matmul, w8a16_matmul
from llmopt.kernels.w8a8 import quantize_per_token_ref
from tests.kernels.helpers import pack_int4, quantize_int4, quantize_int8, requires_triton, to

SHAPES = [(1, 64, 48), (3, 100, 24), (17, 130, 70)]  # (M, K, N): K not a multiple of the block


def _worst_err(y, y64):
    return (y.double() - y64).abs().max().item()


def _check_no_worse_than_torch(y, x, w_dense, dtype):
    """Kernel error vs fp64 must not exceed torch's F.linear at the same dtype (plus slack)."""
    y64 = x.double() @ w_dense.double().t()
    torch_err = _worst_err(F.linear(x, w_dense.to(dtype)), y64)
    assert _worst_err(y, y64) <= 2 * torch_err + 1e-5 * y64.abs().max().item(), (_worst_err(y, y64), torch_err)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
def test_int4_layout_matches_compressed_tensors(group_size, symmetric):
    """Their compressor packs, our unpacking must give their decompressed weight exactly."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    n, k = 24, 256
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric,
                            strategy="channel" if group_size is None else "group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    w = torch.randn(n, k)
    wg = w.view(n, -1, group_size or k)
    scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
    packed = PackedQuantizationCompressor.compress(state, scheme)
    theirs = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
    ours = w4a16_dequantize(packed["weight_packed"], packed["weight_scale"], k, packed.get("weight_zero_point"),
                            group_size)
    assert ("weight_zero_point" in packed) == (not symmetric)
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0)
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)  # the tests' own packer writes their layout
    assert torch.equal(pack_int4(q), pack_to_int32(q, 4))
    assert torch.equal(pack_int4(q[:, :16], packed_dim=0), pack_to_int32(q[:, :16], 4, packed_dim=0))


@requires_triton
@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("group_size, symmetric", [(32, True), (64, False), (128, True), (None, False)])
def test_w4a16_triton(device_dtype, m, k, n, group_size, symmetric):
    device, dtype = device_dtype
    t = to(quantize_int4(torch.randn(n, k), group_size, symmetric), device)
    x = torch.randn(m, k, device=device, dtype=dtype)
    args = (t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"), group_size)
    y = w4a16_matmul(x, *args, backend="triton")
    w = w4a16_dequantize(t["weight_packed"], t["weight_scale"], k, t.get("weight_zero_point"), group_size)
    _check_no_worse_than_torch(y, x, w, dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(y, w4a16_matmul(x, *args, backend="torch"), atol=1e-4, rtol=1e-4)


@requires_triton
@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_w8a16_triton(device_dtype, m, k, n, symmetric):
    device, dtype = device_dtype
    t = to(quantize_int8(torch.randn(n, k), symmetric), device)
    x = torch.randn(m, k, device=device, dtype=dtype)
    args = (t["weight"], t["weight_scale"], t.get("weight_zero_point"))
    y = w8a16_matmul(x, *args, backend="triton")
    zero = t.get("weight_zero_point", torch.zeros(1, device=device)).double()
    _check_no_worse_than_torch(y, x, (t["weight"].double() - zero) * t["weight_scale"].double(), dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(y, w8a16_matmul(x, *args, backend="torch"), atol=1e-4, rtol=1e-4)


@requires_triton
@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_accumulates_like_one_pass(device_dtype, split_k):
    device, dtype = device_dtype
    m, k, n = 3, 330, 40  # 330 = 5 full K tiles + a partial one
    x = torch.randn(m, k, device=device, dtype=dtype)
    t4 = to(quantize_int4(torch.randn(n, k), 64, False), device)
    args4 = (t4["weight_packed"], t4["weight_scale"], t4["weight_zero_point"], 64)
    t8 = to(quantize_int8(torch.randn(n, k)), device)
    for fn, args in ((w4a16_matmul, args4), (w8a16_matmul, (t8["weight"], t8["weight_scale"]))):
        y = fn(x, *args, backend="triton", split_k=split_k)
        assert y.dtype == dtype
        expected = fn(x, *args, backend="triton", split_k=1)
        torch.testing.assert_close(y.float(), expected.float(), **_split_tol(dtype, expected))


def _split_tol(dtype, y):
    """Split-K sums in a different order, then rounds once from fp32."""
    eps = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    return {"rtol": eps, "atol": eps * y.float().abs().max().item()}


def test_w8a16_group_wise_ref():
    w, x = torch.randint(-127, 128, (8, 96), dtype=torch.int8), torch.randn(2, 96)
    scale = torch.rand(8, 3)
    dense = w.double() * scale.double().repeat_interleave(32, 1)
    y = w8a16_matmul(x, w, scale, group_size=32, backend="torch")
    torch.testing.assert_close(y.double(), x.double() @ dense.t(), rtol=1e-5, atol=1e-4)


@requires_triton
@pytest.mark.parametrize("m, k", [(1, 64), (17, 130)])
def test_quantize_per_token(device_dtype, m, k):
    device, dtype = device_dtype
    x = torch.randn(m, k, device=device, dtype=dtype) * torch.logspace(-3, 3, m, device=device)[:, None].to(dtype)
    x[0, :3] = torch.tensor([0.5, -0.5, 0.0], device=device, dtype=dtype) * x[0].abs().max()  # exact halves
    q, s = quantize_per_token(x, backend="triton")
    q_ref, s_ref = quantize_per_token_ref(x)
    torch.testing.assert_close(s, s_ref)
    assert (q.int() - q_ref.int()).abs().max() <= (0 if dtype == torch.float32 else 1)
    assert q.abs().max() <= 127


@requires_triton
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_w8a8_triton(device_dtype, m, k, n):
    device, dtype = device_dtype
    t = to(quantize_int8(torch.randn(n, k)), device)
    x = torch.randn(m, k, device=device, dtype=dtype)
    y = w8a8_matmul(x, t["weight"], t["weight_scale"], backend="triton")
    y_ref = w8a8_matmul(x, t["weight"], t["weight_scale"], backend="torch")
    scale = y_ref.float().abs().max().item()
    torch.testing.assert_close(y.float(), y_ref.float(), atol=1e-5 * scale if dtype == torch.float32 else 1e-2 * scale,
                               rtol=1e-5 if dtype == torch.float32 else 1e-2)


def test_shape_errors_say_what_is_expected():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"int32 \[N, ceil\(K/8\)\]"):
        w4a16_matmul(x, torch.zeros(4, 7, dtype=torch.int32), torch.ones(4, 1))
    with pytest.raises(ValueError, match="groups"):
        w4a16_matmul(x, torch.zeros(4, 8, dtype=torch.int32), torch.ones(4, 3), group_size=32)
    with pytest.raises(ValueError, match="int8"):
        w8a8_matmul(x, torch.zeros(4, 64), torch.ones(4, 1))


def test_group_size_is_inferred_when_exact():
    t = quantize_int4(torch.randn(16, 256), 64, True)
    x = torch.randn(2, 256)
    torch.testing.assert_close(w4a16_matmul(x, t["weight_packed"], t["weight_scale"]),
                               w4a16_matmul(x, t["weight_packed"], t["weight_scale"], group_size=64))
    with pytest.raises(ValueError, match="group_size is required"):
        w4a16_matmul(torch.randn(2, 100), torch.zeros(4, 13, dtype=torch.int32), torch.ones(4, 3))
