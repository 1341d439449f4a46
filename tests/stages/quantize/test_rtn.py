import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle import forward as ct_forward
from compressed_tensors.quantization.utils.helpers import calculate_qparams

from llmopt.stages.errors import ConfigError
from llmopt.stages.quantize.rtn import (QuantArgs, compute_qparams, dequantize, fake_quantize, quantize,
                                        resolve_group_size)

CASES = [(4, 32, True), (4, 64, False), (8, 64, True), (8, 32, False), (4, -1, True), (8, -1, False),
         (4, -1, False), (8, -1, True)]


def ct_args(args: QuantArgs) -> QuantizationArgs:
    if args.group_size == -1:
        return QuantizationArgs(num_bits=args.bits, type="int", strategy="channel", symmetric=args.symmetric)
    return QuantizationArgs(num_bits=args.bits, type="int", strategy="group", group_size=args.group_size,
                            symmetric=args.symmetric)


def ct_qparams(w, args):
    g = w.shape[1] if args.group_size == -1 else args.group_size
    wg = w.reshape(w.shape[0], -1, g)  # [out, in/g, g]
    return calculate_qparams(wg.amin(-1), wg.amax(-1), ct_args(args))


def weights(out=24, cols=192, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=gen)
    w[0, :64] = w[0, :64].abs() + 0.1  # an all-positive group: the range must be widened to 0
    w[1, :64] = -w[1, :64].abs()  # an all-negative group
    w[2, :] = 0  # an all-zero row: scale eps, zero point 0
    w[3, 5] = 40.0  # an outlier
    return w


@pytest.mark.parametrize("bits,group,sym", CASES)
def test_qparams_and_fake_quant_match_compressed_tensors(bits, group, sym):
    args = QuantArgs(bits, group, sym)
    w = weights()
    scale, zero = compute_qparams(w, args)
    ct_scale, ct_zero = ct_qparams(w, args)
    assert scale.dtype == torch.float32 and torch.equal(scale, ct_scale)
    if sym:
        assert zero is None and not ct_zero.any()
    else:
        assert zero.dtype == torch.int8 and torch.equal(zero, ct_zero)
    ct_zp = ct_zero if not sym else None
    expected = ct_forward.fake_quantize(w, ct_scale, ct_zp, ct_args(args))
    assert torch.equal(fake_quantize(w, args), expected)
    q = quantize(w, scale, zero, args)
    assert torch.equal(q, ct_forward.quantize(w, ct_scale, ct_zp, ct_args(args), dtype=torch.int8))
    assert torch.equal(dequantize(q, scale, zero, args), ct_forward.dequantize(q, ct_scale, ct_zp, ct_args(args)))


@pytest.mark.parametrize("bits,group,sym", CASES)
def test_codes_stay_in_signed_range_and_zero_is_exact(bits, group, sym):
    args = QuantArgs(bits, group, sym)
    w = weights(seed=1)
    w[:, ::3] = 0  # "pruned" weights
    scale, zero = compute_qparams(w, args)
    q = quantize(w, scale, zero, args)
    assert q.dtype == torch.int8
    assert q.min() >= -(2 ** (bits - 1)) and q.max() <= 2 ** (bits - 1) - 1
    assert torch.all(dequantize(q, scale, zero, args)[:, ::3] == 0)


def test_symmetric_int4_is_absmax_over_7_5():
    w = torch.tensor([[0.3, -1.5, 0.75, 1.0]])
    scale, zero = compute_qparams(w, QuantArgs(4, -1))
    assert zero is None and scale.item() == pytest.approx(1.5 / 7.5)
    assert quantize(w, scale, None, QuantArgs(4, -1)).tolist() == [[2, -8, 4, 5]]  # -1.5/0.2 = -7.5 -> -8


def test_bf16_weights_quantize_like_float32():
    w = weights(seed=2).bfloat16()
    args = QuantArgs(4, 32, False)
    out = fake_quantize(w, args)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fake_quantize(w.float(), args).bfloat16())


def test_resolve_group_size():
    assert resolve_group_size(1536, None) == 128  # None: auto
    assert resolve_group_size(576, None) == 64
    assert resolve_group_size(96, None) == 32
    assert resolve_group_size(100, None) == -1
    assert resolve_group_size(576, 32) == 32
    assert resolve_group_size(576, -1) == -1
    with pytest.raises(ConfigError, match=r"576 of layer q_proj; valid sizes: 64, 32, -1"):
        resolve_group_size(576, 128, layer="q_proj")


def test_group_size_is_parsed_and_checked_once():
    from llmopt.stages.quantize.config import check_group_size, group_size_text, parse_group_size

    assert [parse_group_size(t) for t in ("auto", None, "-1", "64", 64)] == [None, None, -1, 64, 64]
    with pytest.raises(ConfigError, match="auto, -1 or a positive integer"):
        parse_group_size("big")
    for ok in (None, -1, 2, 32, 128):
        check_group_size(ok)
    for bad in (0, 1, 48, -2, "64", True):
        with pytest.raises(ConfigError, match="power of two"):
            check_group_size(bad)
    # the command line's spelling; manifests written before group sizes were numbers read the same
    assert [group_size_text(v) for v in (None, "auto", -1, "-1", 64, "64")] == ["auto", "auto", "-1", "-1", "64", "64"]


def test_group_that_does_not_divide_is_a_config_error():
    with pytest.raises(ConfigError, match="does not divide"):
        compute_qparams(torch.randn(4, 576), QuantArgs(4, 128))
    with pytest.raises(ConfigError):
        QuantArgs(16, 32)


@pytest.mark.parametrize("sym", [True, False])
def test_mse_observer_never_raises_a_groups_error_and_lowers_the_total(sym):
    args = QuantArgs(4, 32, sym)
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(0))
    errors, scales = {}, {}
    for observer in ("minmax", "mse"):
        scale, zero = compute_qparams(w, args, observer)
        deq = dequantize(quantize(w, scale, zero, args), scale, zero, args)
        errors[observer], scales[observer] = (deq - w).abs().pow(2.4).reshape(16, 4, 32).sum(-1), scale
    assert torch.all(errors["mse"] <= errors["minmax"] * (1 + 1e-6))  # min..max is one of the candidates
    assert errors["mse"].sum() < 0.95 * errors["minmax"].sum()
    assert torch.all(scales["mse"] <= scales["minmax"]) and torch.any(scales["mse"] < scales["minmax"])


def test_unknown_observer_is_a_config_error():
    with pytest.raises(ConfigError, match="observer"):
        compute_qparams(torch.randn(4, 32), QuantArgs(4, 32, True), "percentile")
