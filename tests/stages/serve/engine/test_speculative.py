"""Speculative decoding on a tiny random Llama through the real ModelRunner: greedy output token for token
as plain decoding (n-gram lookup and a draft model), stops inside an accepted run, every block freed."""
import pytest
import torch

from llmopt.kernels import cpu_native
from llmopt.stages.errors import ConfigError
from llmopt.stages.serve.engine.config import EngineConfig, SamplingParams, SpeculativeConfig, speculative_config
from llmopt.stages.serve.engine.engine import LLMEngine
from llmopt.stages.serve.engine.ngram import NgramIndex
from llmopt.stages.serve.engine.speculative import SpecState, accept_greedy
from tests.helpers import write_hf_dir

# Repetitive prompts: a tiny random model falls into loops, which n-gram lookup then guesses.
PROMPTS = ["the quick brown fox the quick brown fox the quick", "a b c d a b c d a b c d a b",
           "pack the weights, verify the hashes, pack the weights", "twelve twelve twelve twelve",
           "the lazy dog jumps over the quick brown fox and a language model"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from llmopt.stages.serve.loader import load_runtime

    path = tmp_path_factory.mktemp("tiny-spec")
    write_hf_dir(path)
    runtime, tokenizer, _ = load_runtime(str(path), "cpu", torch.float32)
    return path, runtime, tokenizer


@pytest.fixture(scope="module")
def draft_runtime(tmp_path_factory):
    """A different random model of the same vocabulary (a second seed, one layer): a poor but valid draft."""
    from llmopt.stages.serve.loader import load_runtime

    path = tmp_path_factory.mktemp("tiny-draft")
    write_hf_dir(path, seed=1, layers=1)
    return load_runtime(str(path), "cpu", torch.float32)[0]


def engine(tiny, spec=None, proposer=None, num_blocks=128, block_size=4, **kw) -> LLMEngine:
    from llmopt.stages.serve.runner import ModelRunner

    _, runtime, tokenizer = tiny
    config = EngineConfig(block_size=block_size, speculative=spec,
                          **{"max_num_batched_tokens": 64, "max_num_seqs": 8, **kw})
    return LLMEngine(ModelRunner(runtime, num_blocks, block_size), tokenizer, config, proposer=proposer)


def draft_engine(tiny, draft_runtime, k=3, **kw) -> LLMEngine:
    from llmopt.stages.serve.engine.draft import DraftProposer
    from llmopt.stages.serve.runner import ModelRunner

    proposer = DraftProposer(ModelRunner(draft_runtime, 64, 4))
    return engine(tiny, SpeculativeConfig("draft", k, model="tiny-draft"), proposer, **kw)


@pytest.fixture(scope="module")
def plain(tiny):
    return [o.token_ids for o in engine(tiny).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("k", [1, 4])
def test_ngram_greedy_is_token_identical_and_frees_every_block(tiny, plain, k):
    eng = engine(tiny, SpeculativeConfig("ngram", k))
    assert [eng.generate([p], GREEDY)[0].token_ids for p in PROMPTS] == plain
    stats = eng.stats()
    assert stats.spec.num_accepted_tokens > 0  # the verify path really ran and kept drafts
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0


@pytest.mark.skipif(not cpu_native.gemv_available(), reason="the fused decode step needs the native GEMVs (AVX-512)")
def test_ngram_two_sequences_share_the_fused_steps_rows(tiny, plain):
    """Decodes and drafts of a step together stay within the fused decode step's rows (fp32: 4)."""
    eng = engine(tiny, SpeculativeConfig("ngram", 4), max_num_seqs=2)
    assert eng.speculator.max_rows == 4
    rows = []
    run = eng.runner.execute
    eng.runner.execute = lambda step: rows.append(step.token_ids.shape[0] if step.is_decode else 0) or run(step)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == plain
    assert eng.stats().spec.num_accepted_tokens > 0 and eng.stats().num_free_blocks == eng.stats().num_blocks
    assert max(rows) == 4  # decode steps with drafts fill the rows, never past them


def test_ngram_one_at_a_time_and_in_multi_token_verify_layout(tiny, plain, monkeypatch):
    from llmopt.stages.serve.engine import engine as engine_module
    from llmopt.stages.serve.engine import inputs

    monkeypatch.setattr(engine_module, "build_step_input",
                        lambda batch, bs: inputs.build_step_input(batch, bs, verify_as_rows=False))
    eng = engine(tiny, SpeculativeConfig("ngram", 3))
    for prompt, ref in zip(PROMPTS, plain):
        assert eng.generate([prompt], GREEDY)[0].token_ids == ref


def test_draft_model_greedy_is_token_identical(tiny, draft_runtime, plain):
    eng = draft_engine(tiny, draft_runtime)
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    stats = eng.stats()
    assert stats.spec.num_draft_tokens > 0 and stats.num_free_blocks == stats.num_blocks
    assert not eng.speculator.proposer.states  # the draft's cache is freed with its sequences too
    assert eng.speculator.proposer.blocks.num_free_blocks == eng.speculator.proposer.blocks.num_blocks


def test_draft_model_equal_to_the_target_accepts_everything(tiny, plain):
    from llmopt.stages.serve.engine.draft import DraftProposer
    from llmopt.stages.serve.runner import ModelRunner

    proposer = DraftProposer(ModelRunner(tiny[1], 64, 4))
    eng = engine(tiny, SpeculativeConfig("draft", 4, model="itself"), proposer)
    assert eng.generate([PROMPTS[4]], GREEDY)[0].token_ids == plain[4]
    assert eng.stats().spec.acceptance_rate == 1.0


@pytest.mark.parametrize("make", ["ngram", "draft"])
def test_stops_inside_an_accepted_run_end_where_plain_decoding_ends(tiny, draft_runtime, plain, make):
    """A stop token, max_tokens and a stop string that fall among accepted drafts cut the run there."""
    stop_token = plain[0][17]  # deep in an accepted run of the looping first prompt
    cases = [SamplingParams(temperature=0, max_tokens=23, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=40, stop_token_ids=(stop_token,), ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=40, stop=(tiny[2].decode(plain[1][20:22]),), ignore_eos=True)]
    for params in cases:
        ref = engine(tiny).generate(PROMPTS[:2], params)
        eng = engine(tiny, SpeculativeConfig("ngram", 4)) if make == "ngram" else draft_engine(tiny, draft_runtime, 4)
        outs = eng.generate(PROMPTS[:2], params)
        assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == \
            [(o.token_ids, o.text, o.finish_reason) for o in ref]
        assert eng.stats().num_free_blocks == eng.stats().num_blocks


def test_sampled_requests_decode_plainly_beside_speculating_ones(tiny, plain):
    eng = engine(tiny, SpeculativeConfig("ngram", 4))
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    ref = engine(tiny).generate([PROMPTS[2]], sampled)[0].token_ids
    for i, (prompt, params) in enumerate([(PROMPTS[0], GREEDY), (PROMPTS[2], sampled)]):
        eng.add_request(str(i), prompt, params)
    tokens = {"0": [], "1": []}
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id == "0" or len(out.token_ids) == 1
            tokens[out.request_id] += out.token_ids
    assert tokens == {"0": plain[0], "1": ref}


def test_a_tiny_cache_preempts_and_still_matches(tiny, plain):
    eng = engine(tiny, SpeculativeConfig("ngram", 4), num_blocks=40, enable_prefix_caching=False)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == plain
    assert eng.stats().num_free_blocks == 40


def test_accept_greedy_keeps_the_agreeing_run_and_the_targets_next_token():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_greedy([5], [4, 1]) == [4]
    assert accept_greedy([], [3]) == [3]


def test_ngram_index_proposes_the_continuation_of_the_longest_latest_match():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    assert index.propose(tokens, 2) == [4, 9]  # the 3-gram "1 2 3" first, though "2 3" was seen later
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3]
    assert NgramIndex(1, 3).propose(tokens, 3) == [5, 7, 2]  # "7 2 3" unseen: the latest "2 3" continues 5
    assert NgramIndex(2, 3).propose([1, 2, 3], 2) == []


def test_spec_state_backs_off_after_misses_and_grows_back():
    state = SpecState(4)
    state.update(4, 1)
    assert state.wants() == 2
    state.update(2, 0)
    assert state.wants() == 1  # one miss: one draft next
    state.update(1, 0)
    assert [state.wants() for _ in range(2)] == [0, 1]  # two in a row: one step paused
    state.update(1, 0)
    assert [state.wants() for _ in range(4)] == [0, 0, 0, 1]
    state.update(1, 1)
    assert state.wants() == 2


def test_speculative_options_parse_ours_and_vllms():
    assert speculative_config(None) is None
    assert speculative_config("ngram", 5) == SpeculativeConfig("ngram", 5)
    assert speculative_config("draft:/a/b") == SpeculativeConfig("draft", model="/a/b")
    vllm = speculative_config(None, None, '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}')
    assert vllm == SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2)
    assert speculative_config(None, None, '{"method": "draft_model", "model": "x"}').model == "x"
    for bad in [("eagle",), ("draft",), ("ngram", 0), (None, 3), ("ngram", None, "{}"), (None, None, "[1]"),
                (None, None, '{"method": "medusa"}')]:
        with pytest.raises(ConfigError):
            speculative_config(*bad)


def test_metrics_show_the_spec_decode_counts_under_vllms_names():
    from llmopt.stages.serve.engine.engine import EngineStats
    from llmopt.stages.serve.engine.speculative import SpecStats
    from llmopt.stages.serve.http.metrics import Scrape, ServerMetrics

    stats = EngineStats(0, 0, 10, 10, 0.0, 0, 0, 0)
    metrics = ServerMetrics("m", lambda: Scrape(stats, {}, True))
    assert b"spec_decode" not in metrics.render()
    stats.spec = SpecStats(num_drafts=3, num_draft_tokens=10, num_accepted_tokens=7)
    text = metrics.render().decode()
    assert 'llmopt:spec_decode_num_draft_tokens_total{model_name="m"} 10.0' in text
    assert 'llmopt:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    assert 'llmopt:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert stats.spec.acceptance_rate == 0.7 and stats.spec.mean_accepted_length == 1 + 7 / 3


def test_a_draft_of_another_vocabulary_is_refused_in_one_line(tiny):
    from llmopt.stages.serve.speculative import check_vocabulary
    from tests.helpers import make_tokenizer

    tokenizer = tiny[2]
    check_vocabulary("d", 300, 300, tokenizer, tokenizer)
    for size, other in ((301, tokenizer), (300, make_tokenizer(200))):
        with pytest.raises(ConfigError, match="must share the target's tokenizer") as error:
            check_vocabulary("d", size, 300, other, tokenizer)
        assert "\n" not in str(error.value)
