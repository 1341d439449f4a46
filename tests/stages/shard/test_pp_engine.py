"""Pipeline-parallel serving on CPU over gloo, through the real rank processes: the same greedy tokens (and
logprobs) as one process for uneven stages (7 layers over 3), stages split for tensor parallelism too, and a
quantized artifact; micro-batches really overlap, and a request aborted while its step is in flight frees
every block."""
import warnings

import pytest
import torch

from llmopt.stages.serve.build import build_engine
from llmopt.stages.serve.engine.config import EngineConfig, SamplingParams
from llmopt.stages.shard.config import ShardConfig
from llmopt.stages.shard.run import run_shard
from tests.helpers import write_hf_dir

PROMPTS = ["the quick brown fox", "a language model predicts", "pack the weights", "twelve small layers of",
           "seven layers over three", "stages hand on", "the residual stream", "one token at a time"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama of 7 layers, 6 query and 2 KV heads (head_dim 16), dense and W4A16."""
    from llmopt.stages.quantize.config import QuantizeConfig
    from llmopt.stages.quantize.run import run_quantize

    root = tmp_path_factory.mktemp("pp")
    write_hf_dir(root / "base", layers=7, hidden=96, heads=6, kv_heads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_quantize(str(root / "base"), root / "w4", QuantizeConfig(method="rtn", scheme="W4A16", group_size=16,
                                                                      eval_windows=0))
    return root


def engine(ref, max_num_seqs: int = 8):
    return build_engine(str(ref), EngineConfig(block_size=4, num_blocks=128, max_num_seqs=max_num_seqs), "cpu",
                        torch.float32, backend="reference")


def close(eng) -> None:
    ranks = getattr(eng.runner, "ranks", None)
    if ranks is not None:
        ranks.close()


def generate(ref) -> list:
    eng = engine(ref)
    try:
        return eng.generate(PROMPTS, GREEDY)
    finally:
        close(eng)


def assert_same(reference, outputs, what: str) -> None:
    for ref, got in zip(reference, outputs, strict=True):
        assert got.token_ids == ref.token_ids, what
        for a, b in zip(ref.logprobs, got.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4, what


@pytest.mark.parametrize("name", ["base", "w4"])
def test_pipeline_stages_match_one_process(models, name):
    reference = generate(models / name)
    for pp, tp in ((3, 1), (2, 2)):
        art = run_shard(str(models / name), models / f"{name}-pp{pp}-tp{tp}", ShardConfig(tp=tp, pp=pp), force=True)
        assert_same(reference, generate(art.path), f"pp={pp} tp={tp}")


def test_micro_batches_overlap_and_an_abort_in_flight_frees_its_blocks(models):
    reference = generate(models / "base")
    art = run_shard(str(models / "base"), models / "base-pp2", ShardConfig(pp=2), force=True)
    eng = engine(art.path)
    try:
        assert eng.pipeline_depth == 2
        for i, prompt in enumerate(PROMPTS):
            eng.add_request(f"r{i}", prompt, GREEDY)
        eng.add_request("doomed", "aborted in flight", GREEDY)
        depths, submit = [], eng.runner.submit
        eng.runner.submit = lambda step: submit(step) or depths.append(eng.runner.in_flight)
        outputs, aborted = {}, False
        while eng.has_unfinished():
            for out in eng.step():
                outputs.setdefault(out.request_id, []).extend(out.token_ids)
            in_flight = {seq.request_id for batch in eng._in_flight for seq in batch.seqs}
            if not aborted and "doomed" in in_flight:
                assert eng.abort("doomed").finish_reason == "abort"
                aborted = True
        assert max(depths) == 2 and aborted  # a second micro-batch went down while the first was in flight
        assert [outputs[f"r{i}"] for i in range(len(PROMPTS))] == [r.token_ids for r in reference]
        stats = eng.stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0
        clocks = eng.runner.stage_clocks()
        assert [c["stage"] for c in clocks] == [0, 1] and all(c["steps"] > 0 for c in clocks)
    finally:
        close(eng)
