import pytest
import torch
import torch.nn.functional as F

from llmopt.stages.quantize.awq import (apply_clip, apply_scale_to_linears, apply_scale_to_norm,
                                        apply_scale_to_prev_linear, awq_search_clip, awq_search_scale,
                                        fake_quantize_clipped, subsample_rows)
from llmopt.stages.quantize.methods import ActivationSampler
from llmopt.stages.quantize.rtn import QuantArgs, fake_quantize

ARGS = QuantArgs(4, 32, True)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def outlier_inputs(n=512, cols=128, seed=0):
    """Activations where a few channels are 30x larger than the rest, as in real LLMs."""
    x = torch.randn(n, cols, generator=gen(seed))
    x[:, [c for c in (3, 40, 77, 100) if c < cols]] *= 30
    return x


def rms_norm(h, weight):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def rel_err(ref, out):
    return (torch.linalg.norm(ref - out) / torch.linalg.norm(ref)).item()


def test_fold_into_norm_keeps_the_float_model():
    h = torch.randn(16, 64, generator=gen(1))
    gamma = torch.rand(64, generator=gen(2)) + 0.5
    ws = [torch.randn(32, 64, generator=gen(3)), torch.randn(24, 64, generator=gen(4))]
    s = torch.rand(64, generator=gen(5)) * 4 + 0.1
    new_gamma, _ = apply_scale_to_norm(gamma, s)
    new_ws = apply_scale_to_linears(ws, s)
    for w, nw in zip(ws, new_ws):
        assert torch.allclose(rms_norm(h, gamma) @ w.t(), rms_norm(h, new_gamma) @ nw.t(), rtol=1e-4, atol=1e-4)


def test_fold_into_previous_linear_keeps_the_mlp():
    x = torch.randn(16, 32, generator=gen(1))
    gate, up = torch.randn(64, 32, generator=gen(2)), torch.randn(64, 32, generator=gen(3))
    up_bias, down = torch.randn(64, generator=gen(4)), torch.randn(32, 64, generator=gen(5))
    s = torch.rand(64, generator=gen(6)) * 4 + 0.1

    def mlp(up, up_bias, down):
        return (F.silu(x @ gate.t()) * (x @ up.t() + up_bias)) @ down.t()

    new_up, new_bias = apply_scale_to_prev_linear(up, s, up_bias)
    (new_down,) = apply_scale_to_linears([down], s)
    assert torch.allclose(mlp(up, up_bias, down), mlp(new_up, new_bias, new_down), rtol=1e-4, atol=1e-4)


def test_fold_keeps_dtype_and_checks_shapes():
    w = torch.randn(8, 16).bfloat16()
    assert apply_scale_to_linears([w], torch.ones(16))[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="shape"):
        apply_scale_to_linears([w], torch.ones(8))
    with pytest.raises(ValueError, match="positive"):
        apply_scale_to_norm(torch.ones(4), torch.tensor([1.0, 0.0, 1.0, 1.0]))


@pytest.mark.parametrize("args", [QuantArgs(4, 32, True), QuantArgs(4, 32, False), QuantArgs(4, -1, True)])
def test_awq_scale_beats_rtn_with_outlier_channels(args):
    x = outlier_inputs()
    ws = [torch.randn(48, 128, generator=gen(10)), torch.randn(40, 128, generator=gen(11))]
    s, best, at_one = awq_search_scale(x, ws, args)
    assert s.shape == (128,) and torch.all(s > 0)
    assert best < 0.9 * at_one
    W = torch.cat(ws)
    ref = x @ W.t()
    awq_out = (x / s) @ fake_quantize(W * s, args).t()
    assert rel_err(ref, awq_out) < 0.95 * rel_err(ref, x @ fake_quantize(W, args).t())
    # the folded form gives the same numbers as the search's loss
    assert torch.mean((awq_out - ref) ** 2).item() == pytest.approx(best, rel=1e-3)


def test_awq_never_worse_than_no_scaling():
    x = torch.randn(256, 64, generator=gen(20))  # no outliers: scaling may not help
    ws = [torch.randn(32, 64, generator=gen(21))]
    s, best, at_one = awq_search_scale(x, ws, ARGS, grid=5)
    assert best <= at_one


def test_awq_subsampling_is_deterministic():
    x = outlier_inputs(n=3000, cols=64, seed=4)
    ws = [torch.randn(32, 64, generator=gen(5))]
    a = awq_search_scale(x, ws, ARGS, max_rows=500)
    b = awq_search_scale(x, ws, ARGS, max_rows=500)
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    rows, weights = subsample_rows(x.reshape(3, 1000, 64), 500)
    assert rows.shape == (500, 64) and weights is None


def test_row_weights_of_zero_drop_rows_from_the_scale_and_clip_searches():
    # Weighting rows 0/1 is the search on the rows of weight 1, for scale and clip, up to float
    # rounding (a weighted mean and a plain one differ in the last bit, which can flip a rounding
    # inside fake quantization and so pick a neighbouring candidate at a near-tie).
    x = outlier_inputs(n=300, cols=64, seed=6)
    ws = [torch.randn(32, 64, generator=gen(7))]
    keep = torch.ones(300)
    keep[::7] = 0
    kept = x[keep.bool()]
    s_w, best_w, one_w = awq_search_scale(x, ws, ARGS, row_weights=keep)
    s_k, best_k, one_k = awq_search_scale(kept, ws, ARGS)
    s_all, best_all, one_all = awq_search_scale(x, ws, ARGS)
    assert one_w == pytest.approx(one_k, rel=1e-6) and one_w != pytest.approx(one_all, rel=1e-3)
    assert best_w == pytest.approx(best_k, rel=0.01)
    assert (s_w - s_k).abs().max() < 0.15 * s_k.abs().max()
    clip_w = awq_search_clip(x, ws[0], ARGS, row_weights=keep)
    same = (clip_w == awq_search_clip(kept, ws[0], ARGS)).float().mean()
    assert same > 0.9


def test_a_heavy_row_steers_the_scale_search():
    # One token with 1000x the others' weight decides the loss: the search fits it, not the rest.
    x = outlier_inputs(n=400, cols=64, seed=8)
    x[0] = 0
    x[0, 5] = 40.0  # a sink-like token: one huge channel the others lack
    ws = [torch.randn(32, 64, generator=gen(9))]
    heavy = torch.ones(400)
    heavy[0] = 1000.0
    plain = awq_search_scale(x, ws, ARGS)[0]
    steered = awq_search_scale(x, ws, ARGS, row_weights=heavy)[0]
    assert not torch.allclose(plain, steered)


@pytest.mark.parametrize("args", [QuantArgs(4, 32, True), QuantArgs(4, 32, False)])
def test_clip_search_lowers_output_error(args):
    x = torch.randn(256, 128, generator=gen(30))
    w = torch.randn(48, 128, generator=gen(31))
    w[:, ::16] *= 4  # a few large weights per group: clipping them can pay off
    max_val = awq_search_clip(x, w, args, rows_per_chunk=20)
    org_max = w.abs().reshape(48, 4, 32).amax(-1)  # [out, in/g]
    assert max_val.shape == (48, 4)
    assert torch.all(max_val <= org_max) and torch.all(max_val >= 0.5 * org_max - 1e-6)
    assert (max_val < org_max).any()
    ref = x @ w.t()
    clipped = x @ fake_quantize_clipped(w, max_val, args).t()
    assert rel_err(ref, clipped) < rel_err(ref, x @ fake_quantize(w, args).t())


def test_apply_clip_clamps_each_group():
    w = torch.tensor([[1.0, -3.0, 2.0, 5.0]])
    out = apply_clip(w, torch.tensor([[2.0, 4.0]]), QuantArgs(4, 2))
    assert out.tolist() == [[1.0, -2.0, 2.0, 4.0]]


def test_activation_sampler_spreads_over_every_batch_and_keeps_norms_aligned():
    sampler = ActivationSampler(max_rows=100)
    for b in range(10):  # 10 batches of 2 x 30 tokens; row value = its running index
        x = torch.arange(b * 60, (b + 1) * 60, dtype=torch.float32).reshape(2, 30, 1).expand(2, 30, 3)
        sampler.add(x, norms=-x[..., 0])
    rows = sampler.sample()
    assert 50 < rows.shape[0] <= 100
    index = rows[:, 0]
    assert torch.equal(index, torch.arange(0, 600, sampler.stride, dtype=torch.float32))  # evenly spaced, all batches
    assert torch.equal(sampler.norms(), -index)
    assert torch.equal(sampler.absmax, torch.full((3,), 599.0))


def test_activation_sampler_without_norms():
    sampler = ActivationSampler(max_rows=8)
    sampler.add(torch.randn(4, 5, generator=gen(1)))
    assert sampler.sample().shape == (4, 5) and sampler.norms() is None
