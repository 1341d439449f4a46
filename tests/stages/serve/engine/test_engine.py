"""LLMEngine and AsyncEngine end to end on a tiny random Llama through the real ModelRunner."""
import asyncio
import random
import threading

import pytest
import torch

from llmopt.stages.serve.engine.async_engine import AsyncEngine, EngineDeadError
from llmopt.stages.serve.engine.config import ContextLengthExceeded, EngineConfig, RequestRejected, SamplingParams
from llmopt.stages.serve.engine.engine import LLMEngine
from tests.helpers import write_hf_dir

PROMPTS = ["the quick brown fox", "a language model predicts", "pack the weights, verify the hashes",
           "twelve", "the lazy dog jumps over the quick brown fox and a language model"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(hf model, runtime, tokenizer) of a tiny random Llama."""
    from llmopt.stages.serve.loader import load_runtime

    path = tmp_path_factory.mktemp("tiny-llama")
    model, _ = write_hf_dir(path)
    runtime, tokenizer, _ = load_runtime(str(path), "cpu", torch.float32)
    return model, runtime, tokenizer


def engine(tiny, num_blocks=128, block_size=4, **kw) -> LLMEngine:
    from llmopt.stages.serve.runner import ModelRunner

    _, runtime, tokenizer = tiny
    config = EngineConfig(block_size=block_size, **{"max_num_batched_tokens": 32, "max_num_seqs": 8, **kw})
    return LLMEngine(ModelRunner(runtime, num_blocks, block_size), tokenizer, config)


def hf_greedy(model, tokenizer, prompt: str, n: int) -> list[int]:
    """transformers' greedy generate, cut after the first EOS (0), as the engine stops there."""
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    return out[:out.index(0) + 1] if 0 in out else out


@pytest.fixture(scope="module")
def reference(tiny):
    model, _, tokenizer = tiny
    return [hf_greedy(model, tokenizer, p, GREEDY.max_tokens) for p in PROMPTS]


def test_greedy_equals_transformers_generate_one_at_a_time(tiny, reference):
    eng = engine(tiny)
    for prompt, ref in zip(PROMPTS, reference):
        assert eng.generate([prompt], GREEDY)[0].token_ids == ref


def test_batched_with_chunked_prefill_equals_reference(tiny, reference):
    eng = engine(tiny, max_num_batched_tokens=8)  # the longest prompt runs in chunks next to decodes
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == ("stop" if o.token_ids[-1] == 0 else "length") for o in outs)


def test_a_lone_long_prompt_in_chunks_samples_only_at_its_end(tiny, reference):
    eng = engine(tiny, max_num_batched_tokens=8)  # 39 prompt tokens: four steps with no logits at all
    assert eng.generate([PROMPTS[4]], GREEDY)[0].token_ids == reference[4]


def test_preemption_under_a_tiny_cache_still_gives_the_reference(tiny, reference):
    eng = engine(tiny, num_blocks=24, enable_prefix_caching=False)  # 96 tokens for 5 requests of ~40
    outs = eng.generate(PROMPTS, GREEDY)
    assert eng.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert eng.stats().num_free_blocks == 24


def test_prefix_cache_hits_give_the_same_tokens(tiny):
    model, _, tokenizer = tiny
    shared = "pack the weights, verify the hashes, and write atomically; the quick brown fox"
    prompts = [shared + tail for tail in (" jumps", " dog", " model")]
    eng = engine(tiny)
    first = eng.generate(prompts[:1], GREEDY)  # fills the cache
    rest = eng.generate(prompts[1:], GREEDY)
    assert eng.stats().prefix_cache_hits >= 2 * 4 * (len(tokenizer.encode(shared)) // 4 - 1)
    for prompt, out in zip(prompts, first + rest):
        assert out.token_ids == hf_greedy(model, tokenizer, prompt, GREEDY.max_tokens)


def test_text_and_deltas_are_consistent(tiny):
    eng = engine(tiny)
    eng.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    deltas, last = [], None
    while eng.has_unfinished():
        for out in eng.step():
            deltas.append(out.delta_text)
            last = out
    assert last.finished and last.finish_reason == "length" and last.num_output_tokens == 10
    assert "".join(deltas) == last.text
    assert last.first_token_time >= last.arrival_time and last.finish_time >= last.first_token_time


def test_stop_token_ids_and_stop_strings(tiny, reference):
    eng = engine(tiny)
    ref = reference[0]
    stop_at = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    out = eng.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(ref[stop_at],)))[0]
    assert out.token_ids == ref[:stop_at + 1] and out.finish_reason == "stop"
    full = eng.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = eng.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, stop=(stop,), ignore_eos=True))[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    alone = engine(tiny).generate([PROMPTS[1]], seeded)[0].token_ids
    eng = engine(tiny)
    others = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"o{i}", p, others)
    eng.add_request("seeded", PROMPTS[1], seeded)
    tokens = []
    while eng.has_unfinished():
        tokens += [t for o in eng.step() if o.request_id == "seeded" for t in o.token_ids]
    assert tokens == alone


def test_logprobs_match_the_model(tiny):
    model, _, tokenizer = tiny
    out = engine(tiny).generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, logprobs=2))[0]
    ids = torch.tensor([tokenizer.encode(PROMPTS[0])])
    with torch.no_grad():
        lp = model(torch.cat([ids, torch.tensor([out.token_ids[:-1]])], 1)).logits[0].log_softmax(-1)
    for step, entry in enumerate(out.logprobs):
        row = lp[ids.shape[1] - 1 + step]
        assert entry.token_id == out.token_ids[step] and entry.logprob == pytest.approx(row.max().item(), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(2).indices.tolist()


def test_rejections_are_clear(tiny):
    eng = engine(tiny, num_blocks=16, max_model_len=64)
    with pytest.raises(RequestRejected, match="max_model_len 64"):
        eng.add_request("long", prompt_token_ids=[5] * 60, params=SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejected, match=r"\[0, 300\)"):
        eng.add_request("bad", prompt_token_ids=[5, 300])
    eng.add_request("a", PROMPTS[0])
    with pytest.raises(RequestRejected, match="already in use"):
        eng.add_request("a", PROMPTS[1])
    assert not eng.stats().num_waiting > 1


def test_many_requests_with_aborts_leave_every_block_free(tiny):
    eng = engine(tiny, num_blocks=40, max_num_seqs=16, max_num_batched_tokens=48)
    rng = random.Random(0)
    pending, finished, aborted = [f"r{i}" for i in range(200)], {}, set()
    while pending or eng.has_unfinished():
        for _ in range(rng.randint(0, 6)):
            if pending:
                rid = pending.pop()
                params = SamplingParams(temperature=rng.choice([0, 1.0]), max_tokens=rng.randint(1, 12),
                                        seed=rng.randint(0, 9))
                eng.add_request(rid, rng.choice(PROMPTS), params)
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
        live = list(eng.scheduler.requests)
        if live and rng.random() < 0.3:
            victim = rng.choice(live)
            assert eng.abort(victim).finish_reason == "abort"
            aborted.add(victim)
    stats = eng.stats()
    assert len(finished) + len(aborted) == 200 and not set(finished) & aborted
    assert stats.num_free_blocks == 40 and stats.kv_cache_usage == 0.0
    assert sum(stats.finished.values()) == 200 and stats.finished["abort"] == len(aborted)


# --- AsyncEngine -------------------------------------------------------------------------------

def test_async_streams_equal_the_sync_engine(tiny, reference):
    async def main(eng):
        async def collect(i):
            tokens = []
            async for out in eng.add_request(f"r{i}", PROMPTS[i], GREEDY):
                tokens += out.token_ids
            return tokens
        return await asyncio.gather(*(collect(i) for i in range(len(PROMPTS))))

    eng = AsyncEngine(engine(tiny, max_wait_ms=20))
    try:
        assert asyncio.run(main(eng)) == reference
        assert eng.is_healthy and eng.stats().num_free_blocks == 128
    finally:
        eng.shutdown()
    assert not eng.is_healthy


def test_async_idle_engine_waits_up_to_max_wait_ms_to_fill_a_batch(tiny):
    params = SamplingParams(temperature=0, max_tokens=2)

    async def first_output(eng, rid):
        async for out in eng.add_request(rid, PROMPTS[0], params):
            return out

    async def main(eng):
        alone = await first_output(eng, "alone")  # nobody else comes: it waits out the deadline
        early = asyncio.ensure_future(first_output(eng, "early"))
        await asyncio.sleep(0.05)
        late = await first_output(eng, "late")
        return alone, await early, late

    eng = AsyncEngine(engine(tiny, max_num_seqs=2, max_wait_ms=300))
    try:
        alone, early, late = asyncio.run(main(eng))
    finally:
        eng.shutdown()
    assert alone.first_token_time - alone.arrival_time >= 0.29
    assert early.first_token_time >= late.arrival_time  # held for the second request, which filled the batch
    assert early.first_token_time - early.arrival_time < 0.29


def test_async_abort_and_early_exit_free_the_request(tiny):
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

    async def main(eng):
        reasons = []
        async for out in eng.add_request("a", PROMPTS[0], params):
            if out.num_output_tokens == 2:
                eng.abort("a")
            reasons.append(out.finish_reason)
        stream = eng.add_request("b", PROMPTS[1], params)
        async for out in stream:
            break  # the consumer leaves: the engine must stop the request
        await stream.aclose()
        await asyncio.sleep(0.2)
        return reasons

    eng = AsyncEngine(engine(tiny))
    try:
        reasons = asyncio.run(main(eng))
        assert reasons[-1] == "abort" and len(reasons) < 60
        assert not eng.engine.has_unfinished() and eng.stats().finished["abort"] == 2
    finally:
        eng.shutdown()


def test_async_rejects_at_once(tiny):
    async def main(eng):
        with pytest.raises(RequestRejected, match="empty"):
            eng.add_request("x", prompt_token_ids=[])

    eng = AsyncEngine(engine(tiny))
    try:
        asyncio.run(main(eng))
        assert eng.is_healthy
    finally:
        eng.shutdown()


def test_async_validate_checks_in_the_callers_thread(tiny):
    inner, gate = engine(tiny, max_model_len=64), threading.Event()
    execute = inner.runner.execute
    inner.runner.execute = lambda step: gate.wait(30) and execute(step)  # "a" cannot finish before the gate

    async def main(eng):
        with pytest.raises(ContextLengthExceeded, match="max_model_len 64"):
            eng.validate([5] * 60, SamplingParams(max_tokens=10))
        with pytest.raises(RequestRejected, match=r"\[0, 300\)"):
            eng.make_request("bad", prompt_token_ids=[5, 300])
        eng.validate([5] * 60, SamplingParams(max_tokens=4))
        stream = eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=2))
        with pytest.raises(RequestRejected, match="already in use"):
            eng.add_request("a", PROMPTS[1])
        gate.set()
        return [out async for out in stream]

    eng = AsyncEngine(inner)
    try:
        outs = asyncio.run(main(eng))
        assert outs[-1].finished and eng.stats().finished == {outs[-1].finish_reason: 1}
    finally:
        gate.set()
        eng.shutdown()


def test_async_load_counts_what_was_handed_over_until_it_finishes(tiny):
    inner, gate = engine(tiny), threading.Event()
    execute = inner.runner.execute
    inner.runner.execute = lambda step: gate.wait(30) and execute(step)  # the loop holds in its first step

    async def main(eng):
        streams = [eng.add_request(rid, prompt_token_ids=[5] * n, params=SamplingParams(max_tokens=2))
                   for rid, n in (("a", 7), ("b", 9))]
        loaded = eng.load()  # handed over or queued in the engine: both count
        gate.set()
        for stream in streams:
            async for _ in stream:
                pass
        eng.abort("a")  # finished: left be, not counted as an abort
        async for _ in eng.add_request("c", prompt_token_ids=[5] * 3, params=SamplingParams(max_tokens=1)):
            pass
        return loaded, eng.load()

    eng = AsyncEngine(inner)
    try:
        assert asyncio.run(main(eng)) == ((2, 16), (0, 0))
        assert "abort" not in eng.stats().finished
    finally:
        gate.set()
        eng.shutdown()


def test_a_dying_loop_fails_every_waiter_and_turns_unhealthy(tiny):
    class Broken(RuntimeError):
        pass

    inner = engine(tiny)
    original = inner.runner.execute

    def execute(step):
        if step.is_decode:
            raise Broken("device lost")
        return original(step)

    inner.runner.execute = execute

    async def main(eng):
        async def consume(i):
            async for _ in eng.add_request(f"r{i}", PROMPTS[i], GREEDY):
                pass
        results = await asyncio.gather(*(consume(i) for i in range(3)), return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) and "device lost" in str(r) for r in results)
        with pytest.raises(EngineDeadError, match="restart"):
            eng.add_request("late", PROMPTS[0], GREEDY)

    eng = AsyncEngine(inner)
    asyncio.run(main(eng))
    assert not eng.is_healthy and isinstance(eng.error, Broken)
    eng.shutdown()


def test_the_ci_gates_slowdown_hook_sleeps_as_long_again_as_each_step_ran(tiny, monkeypatch):
    """LLMOPT_TEST_SLOW_STEP=2 (make bench-ci's deliberate regression): each step sleeps (2 - 1) x its own time,
    measured with the clock the engine reads; unset, nothing sleeps and the outputs are the same."""
    from llmopt.stages.serve.engine import engine as engine_module

    plain = engine(tiny).generate(PROMPTS[:2], GREEDY)
    clock, sleeps = iter(range(0, 10**6, 3)), []  # every step "runs" 3 s
    monkeypatch.setattr(engine_module.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(engine_module.time, "sleep", sleeps.append)
    monkeypatch.setenv("LLMOPT_TEST_SLOW_STEP", "2")
    slowed = engine(tiny).generate(PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in slowed] == [o.token_ids for o in plain]
    assert sleeps and set(sleeps) == {3.0}
    monkeypatch.delenv("LLMOPT_TEST_SLOW_STEP")
    sleeps.clear()
    engine(tiny).generate(PROMPTS[:2], GREEDY)
    assert sleeps == []


@pytest.mark.parametrize("value", ["fast", "0.5", "1000"])
def test_the_slowdown_hook_refuses_a_factor_it_cannot_mean(monkeypatch, value):
    from llmopt.stages.serve.engine.engine import step_slowdown

    monkeypatch.setenv("LLMOPT_TEST_SLOW_STEP", value)
    with pytest.raises(ValueError, match="LLMOPT_TEST_SLOW_STEP"):
        step_slowdown()
