import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle import forward as ct_forward
from compressed_tensors.quantization.utils.helpers import calculate_qparams, compute_dynamic_scales_and_zp

from llmopt.stages.quantize.smoothquant import (apply_scale_to_linears, apply_scale_to_norm,
                                                quantize_act_per_token, quantize_weight_int8_per_channel,
                                                smooth_scales, w8a8_linear_ref)

CT_W = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True)
CT_A = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def outlier_acts(shape=(4, 64, 128), seed=0):
    x = torch.randn(*shape, generator=gen(seed))
    x[..., [7, 90]] *= 60  # the channel outliers SmoothQuant is about
    return x


def rel_err(ref, out):
    return (torch.linalg.norm(ref - out) / torch.linalg.norm(ref)).item()


def test_smooth_scales_formula_and_dead_channels():
    act = torch.tensor([4.0, 1.0, 0.0, 9.0])
    w1 = torch.tensor([[1.0, -4.0, 2.0, 0.0], [0.5, 1.0, 1.0, 0.0]])
    s = smooth_scales(act, [w1, -w1], alpha=0.5)
    assert s.tolist() == pytest.approx([2.0, 0.5, 1.0, 1.0])  # sqrt(a) / sqrt(w); dead channels keep 1
    with pytest.raises(ValueError):
        smooth_scales(act, [w1], alpha=1.5)


def test_smoothing_keeps_the_float_output():
    x = outlier_acts()
    gamma = torch.rand(128, generator=gen(1)) + 0.5
    ws = [torch.randn(64, 128, generator=gen(2)), torch.randn(32, 128, generator=gen(3))]
    s = smooth_scales((x * gamma).abs().amax(dim=(0, 1)), ws)
    new_gamma, _ = apply_scale_to_norm(gamma, s)
    for w, nw in zip(ws, apply_scale_to_linears(ws, s)):
        assert torch.allclose((x * gamma) @ w.t(), (x * new_gamma) @ nw.t(), rtol=1e-4, atol=1e-3)


def test_weight_int8_matches_compressed_tensors_channel_scheme():
    w = torch.randn(48, 128, generator=gen(4))
    q, scale = quantize_weight_int8_per_channel(w)
    ct_scale, _ = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), CT_W)
    assert q.dtype == torch.int8 and scale.shape == (48, 1)
    assert torch.equal(scale, ct_scale)
    assert torch.equal(q, ct_forward.quantize(w, ct_scale, None, CT_W, dtype=torch.int8))


def test_activation_per_token_matches_compressed_tensors_dynamic_scheme():
    x = outlier_acts(seed=5)  # [batch, seq, in]: compressed-tensors reduces the last dim per token
    q, scale = quantize_act_per_token(x)
    ct_scale, _ = compute_dynamic_scales_and_zp(x, CT_A, module=None)
    assert scale.shape == (4, 64, 1) and torch.equal(scale, ct_scale)
    assert torch.equal(q, ct_forward.quantize(x, ct_scale, None, CT_A, dtype=torch.int8))


def test_w8a8_reference_is_the_dequantized_matmul():
    x, w = outlier_acts(seed=6), torch.randn(32, 128, generator=gen(7))
    bias = torch.randn(32, generator=gen(8))
    q_w, w_scale = quantize_weight_int8_per_channel(w)
    y = w8a8_linear_ref(x, q_w, w_scale, bias)
    q_x, x_scale = quantize_act_per_token(x)
    expect = (q_x.double() * x_scale.double()) @ (q_w.double() * w_scale.double()).t() + bias.double()
    assert y.dtype == torch.float32 and y.shape == (4, 64, 32)
    assert torch.allclose(y.double(), expect, rtol=1e-6, atol=1e-5)
    assert rel_err(x @ w.t() + bias, y) < 0.1


def test_smoothing_lowers_w8a8_error_with_outlier_channels():
    x = outlier_acts(seed=9)
    w = torch.randn(64, 128, generator=gen(10))
    ref = x @ w.t()
    plain = w8a8_linear_ref(x, *quantize_weight_int8_per_channel(w))
    s = smooth_scales(x.abs().amax(dim=(0, 1)), [w], alpha=0.5)
    (ws,) = apply_scale_to_linears([w], s)
    smoothed = w8a8_linear_ref(x / s, *quantize_weight_int8_per_channel(ws))
    assert rel_err(ref, smoothed) < 0.5 * rel_err(ref, plain)
