"""Native CPU GEMVs (dense fp32/bf16 and int4 tiles) and per-layer ops against float64 / transformers-style
references; every output must not depend on how many rows share the call."""
import ctypes

import pytest
import torch
import torch.nn.functional as F

from llmopt.kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.gemv_available(),
                                reason="native GEMV needs a C compiler and an AVX-512 CPU")


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("n,k", [(5, 17), (6, 33), (37, 40), (96, 576), (130, 1536)])
@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_dense_fp32_matches_float64(n, k, m):
    w, x, b = _rand(n, k, seed=1), _rand(m, k, seed=2), _rand(n, seed=3)
    y = cpu_native.gemv(x, cpu_native.DenseWeight(w), b)
    ref = x.double() @ w.double().T + b.double()
    assert y.dtype == torch.float32 and y.shape == (m, n)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)  # sums of up to 1,536 unit terms in fp32


def test_dense_bf16_rounds_once_from_fp32_sums():
    w, x = _rand(70, 96, seed=1, dtype=torch.bfloat16), _rand(3, 96, seed=2, dtype=torch.bfloat16)
    y = cpu_native.gemv(x, cpu_native.DenseWeight(w))
    assert y.dtype == torch.bfloat16
    ref = (x.double() @ w.double().T).to(torch.bfloat16)  # the exact sum, rounded to bf16
    assert ((y.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-6).all()


def test_dense_mixed_fp32_activations_on_bf16_weights():
    w, x = _rand(40, 64, seed=1, dtype=torch.bfloat16), _rand(2, 64, seed=2)
    y = cpu_native.gemv(x, cpu_native.DenseWeight(w))
    torch.testing.assert_close(y.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_rows_do_not_depend_on_the_batch(dtype):
    w = cpu_native.DenseWeight(_rand(99, 200, seed=1, dtype=dtype))
    wide = _rand(4, 260, seed=2, dtype=dtype)
    x = wide[:, :200]  # a row stride wider than K, as for a slice of a fused projection
    y = cpu_native.gemv(x, w)
    for i in range(4):
        assert torch.equal(cpu_native.gemv(x[i:i + 1], w)[0], y[i])


def _w4_case(n, k, group, asym, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    zeros = torch.randint(0, 16, (n, k // group), generator=g) if asym else None
    zero = (zeros if asym else torch.full_like(scales, 8)).repeat_interleave(group, 1)
    dense = (q - zero).double() * scales.double().repeat_interleave(group, 1)
    return cpu_native.Int4Weight(q, scales, zeros, group), dense


@pytest.mark.parametrize("n,k,group", [(64, 576, 64), (70, 576, 32), (36, 1536, 128), (12, 96, 96)])
@pytest.mark.parametrize("asym", [False, True])
def test_int4_matches_dequantized_weight(n, k, group, asym):
    weight, dense = _w4_case(n, k, group, asym)
    for m in (1, 2, 3, 4, 7):
        x = _rand(m, k, seed=m)
        y = cpu_native.gemv_w4(x, weight)
        torch.testing.assert_close(y.double(), x.double() @ dense.T, rtol=1e-5, atol=1e-4)


def test_int4_rows_do_not_depend_on_the_batch_and_take_bias_and_bf16():
    weight, dense = _w4_case(50, 128, 32, True, seed=4)
    x, bias = _rand(6, 128, seed=5), _rand(50, seed=6)
    y = cpu_native.gemv_w4(x, weight, bias)
    torch.testing.assert_close(y.double(), x.double() @ dense.T + bias.double(), rtol=1e-5, atol=1e-4)
    for i in range(6):  # rows alone (M = 1, 4-row register blocks) and inside blocks of 2, 3, 4
        assert torch.equal(cpu_native.gemv_w4(x[i:i + 1], weight, bias)[0], y[i])
    assert torch.equal(cpu_native.gemv_w4(x[:3], weight, bias), y[:3])
    yb = cpu_native.gemv_w4(x.bfloat16(), weight)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.double(), x.bfloat16().double() @ dense.T, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("n,k,group", [(64, 576, 576), (70, 40, 40), (36, 1536, 32), (12, 96, 48)])
@pytest.mark.parametrize("asym", [False, True])
def test_int8_matches_dequantized_weight_whatever_the_batch(n, k, group, asym):
    g = torch.Generator().manual_seed(n + asym)
    q = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    groups = max(1, k // group)
    scales = torch.rand(n, groups, generator=g) * 0.01 + 0.001
    zeros = torch.randint(-20, 20, (n, groups), generator=g).to(torch.int8) if asym else None
    size = group if groups > 1 else k
    zero = zeros.double().repeat_interleave(size, 1) if asym else 0
    dense = (q.double() - zero) * scales.double().repeat_interleave(size, 1)
    weight, bias = cpu_native.Int8Weight(q, scales, zeros, group), _rand(n, seed=9)
    x = _rand(5, k, seed=k)
    y = cpu_native.gemv_w8(x, weight, bias)
    torch.testing.assert_close(y.double(), x.double() @ dense.T + bias.double(), rtol=1e-5, atol=1e-4)
    for i in range(5):
        assert torch.equal(cpu_native.gemv_w8(x[i:i + 1], weight, bias)[0], y[i])


def test_bad_shapes_are_refused_with_a_message():
    weight = cpu_native.DenseWeight(_rand(8, 32))
    with pytest.raises(ValueError, match="x must be"):
        cpu_native.gemv(_rand(2, 31), weight)
    with pytest.raises(ValueError, match="bias"):
        cpu_native.gemv(_rand(2, 32), weight, _rand(7))
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_native.Int4Weight(torch.zeros(4, 48, dtype=torch.uint8), torch.ones(4, 3), None, 16)
    with pytest.raises(ValueError, match="fp32/bf16"):
        cpu_native.DenseWeight(torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_native.Int8Weight(torch.zeros(4, 48, dtype=torch.int8), torch.ones(4, 6), None, 8)


def _norm_reference(h, w, eps):  # transformers' LlamaRMSNorm
    hf = h.float()
    return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_add_rms_norm_matches_transformers_and_updates_the_residual(dtype, rows):
    x, r = _rand(rows, 576, seed=1, dtype=dtype), _rand(rows, 576, seed=2, dtype=dtype)
    w = (torch.rand(576, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=0)  # bf16: the same roundings
    torch.testing.assert_close(cpu_native.add_rms_norm(x, w, 1e-5), _norm_reference(x, w, 1e-5), **tol)
    residual = r.clone()
    out, res = cpu_native.add_rms_norm(x, w, 1e-5, residual)
    assert res is residual and torch.equal(residual, x + r)
    torch.testing.assert_close(out, _norm_reference(x + r, w, 1e-5), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_and_rope_match_torch(dtype):
    gu = _rand(20, 2 * 96, seed=1, dtype=dtype) * 4
    gate, up = gu.chunk(2, -1)
    # expf differs from torch's exp by an ulp or so; in bf16 that can move a rounding by one step
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=0)
    torch.testing.assert_close(cpu_native.silu_mul(gu), F.silu(gate) * up, **tol)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=0)
    d, heads = 64, 5
    wide = _rand(20, heads * d + 3 * d, seed=2, dtype=dtype)  # q||k rows inside a wider fused row
    cs = _rand(20, d, seed=3, dtype=dtype)
    x = wide[:, :heads * d].view(20, heads, d)
    cos, sin = cs[:, None, :d // 2].repeat(1, 1, 2), cs[:, None, d // 2:]
    ref = x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * torch.cat([sin, sin], -1)
    rest = wide[:, heads * d:].clone()
    cpu_native.rope_(wide[:, :heads * d], cs, d)
    torch.testing.assert_close(x, ref, **tol)
    assert torch.equal(wide[:, heads * d:], rest)  # what follows q||k in the row is untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_matches_float64(dtype):
    """gelu(gate, approximate="tanh") * up against the formula in fp64, rounded where transformers' MLP rounds
    (the gelu, then the product): fp32 to an ulp or so, bf16 to one rounding step. Inputs reach both tails."""
    gu = _rand(20, 2 * 96, seed=1, dtype=dtype) * 4
    gate, up = gu.double().chunk(2, -1)
    # (1 + tanh(u)) / 2 as sigmoid(2u): the same function, without the cancellation that zeroes it for u < -19
    # even in fp64
    gelu = gate * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3))
    ref = gelu.to(dtype) * up.to(dtype)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=0)
    out = cpu_native.gelu_tanh_mul(gu)
    assert out.dtype == dtype and out.shape == (20, 96)
    torch.testing.assert_close(out, ref, **tol)
    wide = torch.cat([gu, gu[:, :5]], 1)[:, :2 * 96]  # rows with a stride wider than 2I
    torch.testing.assert_close(cpu_native.gelu_tanh_mul(wide), out, rtol=0, atol=0)



def test_quantized_gemvs_hold_fp32_accuracy_with_outliers_zero_rows_and_many_rows():
    """The VNNI paths hold x as a 24-bit fixed point per block of inputs: an outlier 50 times the rest
    leaves its block's small entries ~18 bits, within fp32's rounding of the sum; an all-zero row gives
    zeros; rows beyond the driver's chunk of 16 match their single-row results."""
    weight4, dense4 = _w4_case(44, 256, 64, False, seed=11)
    g = torch.Generator().manual_seed(12)
    q8 = torch.randint(-128, 128, (44, 256), generator=g).to(torch.int8)
    s8 = torch.rand(44, 4, generator=g) * 0.01 + 0.001
    weight8, dense8 = cpu_native.Int8Weight(q8, s8, None, 64), q8.double() * s8.double().repeat_interleave(64, 1)
    x = _rand(18, 256, seed=13)
    x[1, 7] = 50.0  # an outlier row
    x[2] = 0.0
    for gemv, weight, dense in ((cpu_native.gemv_w4, weight4, dense4), (cpu_native.gemv_w8, weight8, dense8)):
        y = gemv(x, weight)
        ref = x.double() @ dense.T
        scale = x.double().abs() @ dense.abs().T  # the size of the terms: fp32 rounding is relative to it
        assert ((y.double() - ref).abs() <= 2e-6 * scale).all(), gemv.__name__
        assert torch.equal(y[2], torch.zeros(44))
        for i in (0, 1, 16, 17):
            assert torch.equal(gemv(x[i:i + 1], weight)[0], y[i])


def _amx_int8_cpu() -> bool:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "amx_int8" in flags and "amx_tile" in flags


def test_the_amx_form_is_taken_where_the_cpu_has_amx_int8():
    # groups of whole 64-input chunks go to the AMX-INT8 form for more than one row; elsewhere vpdpbusd
    taken = cpu_native.native_function("llmopt_vnni_amx", [ctypes.c_int64, ctypes.c_int64])
    assert taken(576, 64) == int(_amx_int8_cpu()) and taken(576, 32) == 0 and taken(96, 96) == 0


@pytest.mark.parametrize("n,k,group,asym", [(100, 576, 64, True), (3072 // 16, 576, 64, False), (40, 1536, 128, True),
                                            (36, 576, 192, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_rows_are_the_same_alone_as_in_any_batch_on_every_form(n, k, group, asym, dtype):
    # one row runs on vpdpbusd, more on AMX-INT8 where the CPU has it (5 rows a tile, 10 per pass, a partial
    # group of tiles at the end): a row's outputs must be bit-identical in every case, and accurate
    weight, dense = _w4_case(n, k, group, asym, seed=n)
    x = _rand(12, k, seed=k, dtype=dtype)
    g = torch.Generator().manual_seed(group)
    q8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s8 = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    w8 = cpu_native.Int8Weight(q8, s8, None, group)
    dense8 = q8.double() * s8.double().repeat_interleave(group, 1)
    for fn, w, d in ((cpu_native.gemv_w4, weight, dense), (cpu_native.gemv_w8, w8, dense8)):
        alone = torch.cat([fn(x[i:i + 1], w) for i in range(12)])
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(alone.double(), x.double() @ d.T, **tol)
        for m in (2, 3, 5, 6, 10, 11, 12):
            assert torch.equal(fn(x[:m], w), alone[:m]), (fn.__name__, m)
