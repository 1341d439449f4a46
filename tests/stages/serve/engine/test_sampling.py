"""Sampler: greedy, truncation masks, per-request seeds inside any batch, penalties, logprobs."""
import pytest
import torch

from llmopt.stages.errors import ConfigError
from llmopt.stages.serve.engine.config import SamplingParams
from llmopt.stages.serve.engine.sampling import Sampler, apply_penalties, truncated_probs
from llmopt.stages.serve.engine.sequence import Sequence

V = 50


def seq(rid="r", prompt=(1, 2, 3), output=(), **params) -> Sequence:
    s = Sequence(rid, list(prompt), SamplingParams(**params))
    s.token_ids += list(output)
    return s


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_batch_is_argmax():
    x = logits(4)
    out = Sampler()(x, [seq(temperature=0) for _ in range(4)])
    assert out.token_ids == x.argmax(-1).tolist() and out.logprobs == [None] * 4


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    x = logits(3)
    out = Sampler()(x, [seq(temperature=0), seq(temperature=1.0), seq(temperature=0, logprobs=2)])
    assert out.token_ids[0] == x[0].argmax() and out.token_ids[2] == x[2].argmax()


def test_top_k_keeps_only_the_k_best():
    x = logits(2)
    probs = truncated_probs(x, [SamplingParams(top_k=3), SamplingParams(top_k=1)])
    assert set(probs[0].nonzero().flatten().tolist()) == set(x[0].topk(3).indices.tolist())
    assert probs[1].nonzero().flatten().tolist() == [int(x[1].argmax())]


def test_top_p_keeps_the_smallest_set_reaching_p():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = truncated_probs(x, [SamplingParams(top_p=0.7)])
    assert probs[0].nonzero().flatten().tolist() == [0, 1]
    assert torch.allclose(probs[0, :2], torch.tensor([0.625, 0.375]))
    tiny = truncated_probs(x, [SamplingParams(top_p=0.01)])
    assert tiny[0].nonzero().flatten().tolist() == [0]  # the best token always survives


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = truncated_probs(x, [SamplingParams(min_p=0.25)])  # threshold 0.125
    assert probs[0].nonzero().flatten().tolist() == [0, 1, 2]


def test_temperature_sharpens_and_flattens():
    x = logits(1)
    cold = truncated_probs(x, [SamplingParams(temperature=0.1)])
    hot = truncated_probs(x, [SamplingParams(temperature=10.0)])
    assert cold.max() > 0.9 and hot.max() < 0.2


def test_seeded_request_is_reproducible_in_any_batch():
    x = logits(6, seed=1) / 3  # flat enough that draws differ
    target = x[2]

    def draw(batch_rows: list[torch.Tensor], position: int, steps: int = 5) -> list[int]:
        seqs = [seq(f"o{i}", temperature=1.0) for i in range(len(batch_rows))]
        seqs[position] = seq("t", temperature=1.0, seed=1234)
        sampler, tokens = Sampler(seed=len(batch_rows)), []
        for _ in range(steps):
            tokens.append(sampler(torch.stack(batch_rows), seqs).token_ids[position])
        return tokens

    alone = draw([target], 0)
    assert draw([x[0], x[1], target, x[3]], 2) == alone
    assert draw([target, x[5]], 0) == alone
    assert len(set(alone)) > 1  # it is really sampling


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    x = torch.log(probs).expand(4000, 4).clone()
    tokens = Sampler(seed=3)(x, [seq(str(i), temperature=1.0) for i in range(4000)]).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03) and freq[3] == 0


def test_penalties_math():
    x = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    s = seq(prompt=(0, 1), output=(2, 2, 3), repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(x.clone(), [s])[0]
    # repetition (prompt + output): 0, 1, 2, 3 seen; presence/frequency: output only (2 twice, 3 once)
    expected = torch.tensor([2.0 / 2, -2.0 * 2, 1.0 / 2 - 0.5 - 0.5, 0.5 / 2 - 0.5 - 0.25, 3.0])
    assert torch.allclose(out, expected)


def test_penalties_apply_per_row_and_change_greedy_choice():
    x = torch.tensor([[5.0, 4.9, 0.0], [5.0, 4.9, 0.0]])
    seqs = [seq(prompt=(2,), output=(0,), temperature=0, frequency_penalty=1.0),
            seq(prompt=(2,), output=(0,), temperature=0)]
    assert Sampler()(x, seqs).token_ids == [1, 0]


def test_logprobs_of_the_chosen_token_and_top_n():
    x = logits(2)
    out = Sampler()(x, [seq(temperature=0, logprobs=3), seq(temperature=0)])
    lp = x[0].log_softmax(-1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0] and first.logprob == pytest.approx(lp.max().item(), abs=1e-5)
    assert [t for t, _ in first.top] == lp.topk(3).indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(lp.topk(3).values.tolist(), abs=1e-5)
    assert out.logprobs[1] is None
    none_top = Sampler()(x[:1], [seq(temperature=0, logprobs=0)]).logprobs[0]
    assert none_top.top == []


@pytest.mark.parametrize("params, message", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"max_tokens": 0}, "max_tokens"), ({"logprobs": 50}, "logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stop": ("",)}, "stop strings"),
])
def test_bad_sampling_params_raise_config_error(params, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**params)


def test_a_single_stop_string_becomes_a_tuple():
    assert SamplingParams(stop="END").stop == ("END",)
