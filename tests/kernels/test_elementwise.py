"""rms_norm, silu_and_mul, gelu_tanh_and_mul and rotary: Triton kernel vs torch twin, twin vs first principles."""
import math

import pytest
import torch

from llmopt.kernels import apply_rotary, build_cos_sin_cache, gelu_tanh_and_mul, rms_norm, silu_and_mul
from llmopt.kernels.rotary import apply_rotary_ref
from tests.kernels.helpers import assert_close, requires_triton

pytestmark = requires_triton


@pytest.mark.parametrize("rows, hidden", [(1, 64), (3, 33), (17, 576)])
def test_rms_norm(device_dtype, rows, hidden):
    device, dtype = device_dtype
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    w = torch.rand(hidden, device=device, dtype=dtype) + 0.5
    ref = rms_norm(x, w, 1e-6, backend="torch")
    assert_close(rms_norm(x, w, 1e-6, backend="triton"), ref, dtype)
    x64 = x.double()
    assert_close(ref, x64 / x64.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * w.double(), dtype)


@pytest.mark.parametrize("shape", [(1, 64), (2, 3, 33)])
def test_rms_norm_fused_residual(device_dtype, shape):
    device, dtype = device_dtype
    x, res = torch.randn(*shape, device=device, dtype=dtype), torch.randn(*shape, device=device, dtype=dtype)
    w = torch.rand(shape[-1], device=device, dtype=dtype)
    ref_out, ref_res = rms_norm(x, w, 1e-5, residual=res.clone(), backend="torch")
    res_t = res.clone()
    out, new_res = rms_norm(x, w, 1e-5, residual=res_t, backend="triton")
    assert new_res is res_t  # updated in place
    assert_close(new_res, ref_res, dtype)
    assert_close(out, ref_out, dtype)
    assert_close(ref_out, rms_norm(x + res, w, 1e-5, backend="torch"), dtype)


@pytest.mark.parametrize("shape", [(1, 128), (3, 2, 70), (17, 3072)])
def test_silu_and_mul(device_dtype, shape):
    device, dtype = device_dtype
    x = torch.randn(*shape, device=device, dtype=dtype)
    ref = silu_and_mul(x, backend="torch")
    assert_close(silu_and_mul(x, backend="triton"), ref, dtype)
    gate, up = x.double().chunk(2, -1)
    assert_close(ref, gate * torch.sigmoid(gate) * up, dtype)


def gelu_tanh_float64(gate):
    """transformers' gelu_pytorch_tanh in fp64, 0.5 g (1 + tanh(u)) written as g sigmoid(2u): the same function,
    without the cancellation of 1 + tanh(u) in the negative tail."""
    return gate * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3))


@pytest.mark.parametrize("shape", [(1, 128), (3, 2, 70), (17, 3072)])
def test_gelu_tanh_and_mul(device_dtype, shape):
    device, dtype = device_dtype
    x = torch.randn(*shape, device=device, dtype=dtype) * 4  # into both tails, where 1 + tanh cancels
    ref = gelu_tanh_and_mul(x, backend="torch")
    assert_close(gelu_tanh_and_mul(x, backend="triton"), ref, dtype)
    gate, up = x.double().chunk(2, -1)
    assert_close(ref, gelu_tanh_float64(gate) * up, dtype)


def test_gelu_tanh_and_mul_refuses_an_odd_width():
    with pytest.raises(ValueError, match="must be even"):
        gelu_tanh_and_mul(torch.randn(2, 7), backend="torch")


def _rotate_half_reference(x, cos, sin):
    """HF-Llama formula on full head_dim: x * cos + rotate_half(x) * sin."""
    x1, x2 = x.chunk(2, -1)
    return x * torch.cat([cos, cos], -1) + torch.cat([-x2, x1], -1) * torch.cat([sin, sin], -1)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("tokens, rot_dim", [(1, 16), (5, 16), (17, 8)])
def test_rotary(device_dtype, is_neox, tokens, rot_dim):
    device, dtype = device_dtype
    cache = build_cos_sin_cache(16, 64, theta=1e4, rotary_dim=rot_dim, device=device)
    qkv = torch.randn(tokens, 7, 16, device=device, dtype=dtype)
    q, k = qkv[:, :4], qkv[:, 4:6]  # strided views of a fused projection, as the engine has them
    pos = torch.randint(0, 64, (tokens,), device=device)
    q_ref, k_ref = apply_rotary(q.clone(), k.clone(), pos, cache, is_neox, backend="torch")
    untouched = qkv[:, 6].clone()
    apply_rotary(q, k, pos, cache, is_neox, backend="triton")
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    assert torch.equal(qkv[:, 6], untouched)


def test_rotary_ref_matches_llama_formula():
    cache = build_cos_sin_cache(16, 32, theta=1e5, dtype=torch.float64)
    q, k = torch.randn(6, 3, 16, dtype=torch.float64), torch.randn(6, 1, 16, dtype=torch.float64)
    pos = torch.tensor([0, 1, 5, 9, 30, 31])
    cos, sin = cache[pos, None, :8], cache[pos, None, 8:]
    expect_q, expect_k = _rotate_half_reference(q, cos, sin), _rotate_half_reference(k, cos, sin)
    apply_rotary_ref(q, k, pos, cache, is_neox=True)
    torch.testing.assert_close(q, expect_q)
    torch.testing.assert_close(k, expect_k)


def test_llama3_scaling_matches_transformers():
    pytest.importorskip("transformers", reason="transformers is not installed")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    config = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=scaling)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    cache = build_cos_sin_cache(128, 4, rope_scaling=scaling, dtype=torch.float64)
    ours = torch.atan2(cache[1, 64:], cache[1, :64])  # angle at position 1 = inv_freq
    torch.testing.assert_close(ours, inv_freq.double(), rtol=1e-6, atol=1e-9)


def test_linear_scaling_and_unknown_type():
    plain = build_cos_sin_cache(8, 16, dtype=torch.float64)
    linear = build_cos_sin_cache(8, 32, rope_scaling={"type": "linear", "factor": 2.0}, dtype=torch.float64)
    torch.testing.assert_close(linear[::2][:16], plain)
    with pytest.raises(ValueError, match="not supported"):
        build_cos_sin_cache(8, 4, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert math.isclose(float(plain[3, 0]), math.cos(3.0))
