"""The one request check (RequestChecker) and the one finish decision (stopping.append_token), no model."""
import pytest

from llmopt.stages.serve.engine.config import ContextLengthExceeded, EngineConfig, RequestRejected, SamplingParams
from llmopt.stages.serve.engine.request import RequestChecker
from llmopt.stages.serve.engine.sequence import Sequence
from llmopt.stages.serve.engine.stopping import append_token


def checker(num_blocks=64, block_size=4, max_len=128, vocab_size=None) -> RequestChecker:
    return RequestChecker(EngineConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=max_len),
                          vocab_size)


def params(max_tokens=4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("n_prompt, max_tokens, message", [
    (0, 4, "empty"),
    (128, 4, "max_model_len"),
    (120, 10, "shorten the prompt or lower max_tokens"),
])
def test_requests_that_can_never_run_are_rejected(n_prompt, max_tokens, message):
    # moved from the scheduler's tests: a request is checked before it becomes a Sequence, so a
    # rejected one never reaches the queue at all
    with pytest.raises(RequestRejected, match=message):
        checker(max_len=128).request("x", list(range(n_prompt)), params(max_tokens))


def test_request_larger_than_the_cache_is_rejected():
    with pytest.raises(RequestRejected, match="cache has 4 blocks"):
        checker(num_blocks=4, block_size=4, max_len=128).check(list(range(10)), params(10))
    with pytest.raises(RequestRejected, match="may grow to 128 tokens"):  # no max_tokens: up to max_model_len
        checker(num_blocks=4, block_size=4, max_len=128).check([1, 2], SamplingParams(max_tokens=None))


def test_too_long_is_its_own_kind_with_or_without_max_tokens():
    check = checker(max_len=16).check
    with pytest.raises(ContextLengthExceeded, match="prompt has 16 tokens but max_model_len is 16"):
        check(list(range(16)), SamplingParams(max_tokens=None))
    with pytest.raises(ContextLengthExceeded, match=r"prompt \(10 tokens\) \+ max_tokens \(7\) exceeds"):
        check(list(range(10)), params(7))
    check(list(range(15)), SamplingParams(max_tokens=None))  # room for exactly one new token
    check(list(range(10)), params(6))


def test_token_ids_outside_the_vocabulary():
    with pytest.raises(RequestRejected, match=r"\[0, 50\)") as caught:
        checker(vocab_size=50).check([1, 50], params())
    assert not isinstance(caught.value, ContextLengthExceeded)
    checker(vocab_size=50).check([0, 49], params())


def test_a_checked_request_keeps_what_it_was_given():
    request = checker().request(7, [3, 4, 5], params(2), arrival_time=12.5)
    assert (request.request_id, request.prompt_token_ids, request.arrival_time) == ("7", (3, 4, 5), 12.5)
    assert request.params == params(2)


def sequence(**kw) -> Sequence:
    return Sequence("s", [1, 2, 3], SamplingParams(**{"max_tokens": 5, **kw}), eos_token_ids=frozenset({0}))


def test_append_token_decides_stop_and_length():
    assert append_token(sequence(), 0, max_model_len=100) == "stop"  # EOS
    assert append_token(sequence(ignore_eos=True), 0, max_model_len=100) is None
    assert append_token(sequence(stop_token_ids=(9,)), 9, max_model_len=100) == "stop"
    assert append_token(sequence(), 7, max_model_len=4) == "length"  # the model's length
    seq = sequence(max_tokens=2)
    assert [append_token(seq, t, max_model_len=100) for t in (7, 8)] == [None, "length"]
    assert seq.output_token_ids == [7, 8]
