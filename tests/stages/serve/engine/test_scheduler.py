"""Scheduler as pure bookkeeping (no model): budgets, chunked prefill, preemption, aborts, finishing."""
import pytest

from llmopt.stages.errors import ConfigError
from llmopt.stages.serve.engine.config import EngineConfig, RequestRejected, SamplingParams
from llmopt.stages.serve.engine.scheduler import Scheduler
from llmopt.stages.serve.engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, max_len=128, **kw) -> Scheduler:
    return Scheduler(EngineConfig(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                                  max_num_seqs=max_seqs, max_model_len=max_len, **kw))


def seq(rid, n_prompt, max_tokens=4, first=0, arrival=None) -> Sequence:
    return Sequence(rid, [first + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    arrival_time=arrival)


def step(s: Scheduler, token: int = 7):
    """One engine step without a model: every sampled sequence gets `token`."""
    batch = s.schedule()
    s.postprocess(batch, [token] * len(batch.sampled_seqs))
    return batch


def run_to_end(s: Scheduler, limit=10_000) -> int:
    steps = 0
    while s.has_unfinished():
        step(s)
        steps += 1
        assert steps < limit, "no progress"
    return steps


def test_chunked_prefill_respects_the_token_budget():
    s = make(budget=8)
    long = seq("long", 20)
    s.add(long)
    sizes = [step(s).num_new_tokens for _ in range(3)]
    assert sizes == [[8], [8], [4]]
    assert long.num_output_tokens == 1  # sampled only once the whole prompt has run


def test_decodes_go_first_and_prefill_gets_the_rest():
    s = make(budget=8)
    for r in ("a", "b"):
        s.add(seq(r, 3, max_tokens=20, first=100))
    step(s)  # both prefills fit: 6 tokens
    s.add(seq("long", 30))
    for _ in range(4):
        batch = step(s)
        assert [q.request_id for q in batch.seqs[:2]] == ["a", "b"]
        assert batch.num_new_tokens[:2] == [1, 1]
        assert batch.num_tokens <= 8
    assert s.running[2].num_computed_tokens == 24  # 6 tokens of the long prompt per step


def test_max_num_seqs_caps_the_running_batch():
    s = make(max_seqs=2, budget=32)
    for i in range(5):
        s.add(seq(f"r{i}", 3))
    batch = step(s)
    assert len(batch) == 2 and len(s.waiting) == 3
    run_to_end(s)


def test_max_batch_size_is_a_further_cap():
    s = make(max_seqs=8, max_batch_size=3)
    for i in range(5):
        s.add(seq(f"r{i}", 3))
    assert len(step(s)) == 3


def test_preemption_under_a_tiny_cache_finishes_everything():
    # 6 blocks of 4 tokens; each request grows to 4 + 12 = 16 tokens = 4 blocks: they cannot all fit.
    s = make(num_blocks=6, block_size=4, max_len=16, enable_prefix_caching=False)
    seqs = [seq(f"r{i}", 4, max_tokens=12, first=10 * i) for i in range(4)]
    for q in seqs:
        s.add(q)
    run_to_end(s)
    assert s.num_preemptions > 0
    assert all(q.finish_reason == "length" and q.num_output_tokens == 12 for q in seqs)
    assert s.block_manager.num_free_blocks == 6


def test_preempted_sequence_is_requeued_first_and_recomputed():
    s = make(num_blocks=4, block_size=2, max_len=8, enable_prefix_caching=False)
    old, new = seq("old", 2, max_tokens=6), seq("new", 2, max_tokens=6, first=50)
    s.add(old)
    s.add(new)
    while not s.num_preemptions:
        step(s)
    assert s.waiting[0] is new and new.status is SequenceStatus.WAITING and new.block_table == []
    outputs_before = new.num_output_tokens
    run_to_end(s)
    assert new.num_output_tokens == 6 and outputs_before > 0


def test_abort_frees_every_block():
    s = make(num_blocks=16, block_size=4, budget=8)
    seqs = [seq(f"r{i}", 10, max_tokens=50, first=i) for i in range(4)]
    for q in seqs:
        s.add(q)
    step(s)
    step(s)
    for q in seqs:
        s.finish(q, "abort")
    assert not s.has_unfinished()
    assert s.block_manager.num_free_blocks == 16
    assert s.finished_by_reason["abort"] == 4 and all(q.finish_reason == "abort" for q in seqs)


def test_a_request_id_in_use_is_rejected_and_not_queued_twice():
    s = make()
    s.add(seq("a", 3))
    with pytest.raises(RequestRejected, match="already in use"):
        s.add(seq("a", 5))
    assert len(s.waiting) == 1 and s.waiting[0].num_prompt_tokens == 3


def test_abort_by_id_and_the_queued_prompt_tokens():
    s = make(budget=8)
    first, second = seq("a", 6, max_tokens=10), seq("b", 20, max_tokens=10)
    s.add(first)
    s.add(second)
    assert s.num_queued_prompt_tokens == 26
    step(s)  # a's whole prompt and 2 tokens of b's: a has its first token, b is still in prefill
    assert s.num_queued_prompt_tokens == 20
    assert s.abort("b") is second and second.finish_reason == "abort"
    assert s.abort("b") is None and s.abort("nobody") is None
    assert s.num_queued_prompt_tokens == 0 and list(s.requests) == ["a"]


def test_prefix_hits_skip_prefill_work():
    s = make(block_size=4, budget=64)
    s.add(seq("a", 13))
    step(s)
    s.add(seq("b", 13))
    batch = step(s)
    assert batch.num_new_tokens == [1, 1]  # a decodes; b runs only its last token
    assert s.block_manager.prefix_hits == 12


def test_fill_wait_only_when_idle_and_the_queue_is_short():
    s = make(max_seqs=4, max_wait_ms=50)
    assert s.fill_wait_s(now=0.0) == 0.0
    s.add(seq("a", 3, arrival=100.0))
    assert s.fill_wait_s(now=100.01) == pytest.approx(0.04)
    assert s.fill_wait_s(now=100.2) == 0.0
    for i in range(3):
        s.add(seq(f"b{i}", 3, arrival=100.0))
    assert s.fill_wait_s(now=100.01) == 0.0  # a full batch is waiting: go


def test_engine_config_validation():
    with pytest.raises(ConfigError, match="--max-num-batched-tokens"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ConfigError, match="--block-size"):
        EngineConfig(block_size=0)
    with pytest.raises(ConfigError, match="KV cache holds"):
        EngineConfig(block_size=4, max_model_len=100).resolved(num_blocks=10, model_max_len=4096)
    assert EngineConfig(block_size=4).resolved(num_blocks=10, model_max_len=4096).max_model_len == 40


def test_pipeline_micro_batches_skip_sequences_in_flight_and_share_the_seats():
    """serve/pp: a batch leaves out the sequences whose step is in flight and holds at most its share."""
    s = make(max_seqs=4, budget=32)
    for r in "abcd":
        s.add(seq(r, 2, max_tokens=8))
    first = s.schedule(max_seqs=2)
    assert [q.request_id for q in first.seqs] == ["a", "b"]
    second = s.schedule(frozenset(map(id, first.seqs)), max_seqs=2)
    assert [q.request_id for q in second.seqs] == ["c", "d"]
    busy = frozenset(map(id, first.seqs + second.seqs))
    assert not s.schedule(busy, max_seqs=2)  # everything is in flight: nothing to run
    s.postprocess(first, [7, 7])
    third = s.schedule(frozenset(map(id, second.seqs)), max_seqs=2)
    assert [q.request_id for q in third.seqs] == ["a", "b"] and third.num_new_tokens == [1, 1]


def test_preemption_never_takes_a_sequence_in_flight():
    s = make(num_blocks=3, block_size=2, max_seqs=2, budget=32)
    a, b = seq("a", 2, max_tokens=8), seq("b", 2, max_tokens=8)
    s.add(a)
    s.add(b)
    s.postprocess(s.schedule(), [7, 7])  # each holds one full block; one block is free
    in_flight = s.schedule(frozenset({id(a)}), max_seqs=1)  # b's decode takes the free block
    assert in_flight.seqs == [b]
    batch = s.schedule(frozenset({id(b)}), max_seqs=1)  # a needs a block: b is in flight, so a waits itself
    assert not batch and a.status is SequenceStatus.WAITING and b in s.running


def test_a_sequence_aborted_in_flight_is_skipped_when_its_step_comes_back():
    s = make()
    a, b = seq("a", 3, max_tokens=4), seq("b", 3, max_tokens=4)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    s.abort("a")
    assert s.postprocess(batch, [5, 6]) == [[], [6]]  # a's row is dropped, b keeps its token
    assert a.output_token_ids == [] and b.output_token_ids == [6]
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks - 1
