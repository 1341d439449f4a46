"""Attention-sink token weighting of the GPTQ Hessian."""
import torch

from llmopt.stages.quantize.gptq import HessianAccumulator, sink_token_weights


def test_sink_tokens_get_the_requested_share():
    torch.manual_seed(0)
    hidden = torch.randn(2, 100, 16)
    hidden[:, 0] *= 50  # a massive-activation token at position 0 of each window
    w = sink_token_weights(hidden, share=0.2)
    assert w.shape == (2, 100)
    sinks = torch.zeros(2, 100, dtype=torch.bool)
    sinks[:, 0] = True
    assert torch.all(w[~sinks] == 1)
    assert torch.isclose(w[sinks].sum() / w.sum(), torch.tensor(0.2))


def test_no_sinks_or_zero_share_means_plain_mean():
    hidden = torch.randn(2, 50, 16)
    assert sink_token_weights(hidden, share=0.1) is None
    hidden[:, 0] *= 50
    assert sink_token_weights(hidden, share=0.0) is None


def test_weighted_hessian_equals_repeated_rows():
    torch.manual_seed(1)
    x = torch.randn(1, 6, 8)
    weights = torch.tensor([[3.0, 1, 1, 1, 1, 1]])
    weighted = HessianAccumulator(8)
    weighted.add(x, weights)
    repeated = HessianAccumulator(8)
    repeated.add(torch.cat([x[:, :1], x[:, :1], x], dim=1))  # token 0 three times
    # Same shape of H up to the token count used for the mean (6 rows vs 8).
    torch.testing.assert_close(weighted.hessian * 6 / 8, repeated.hessian, rtol=1e-5, atol=1e-6)
