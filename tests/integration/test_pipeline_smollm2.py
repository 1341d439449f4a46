"""Pipeline parallelism on the embedded SmolLM2-135M (fp32, greedy): PP2, PP3 and PP2 x TP2, each stage a
process over gloo, give the same tokens as one process for 10 chat prompts x 32 new tokens, submitted
together (so the micro-batches overlap)."""
import json

import pytest
import torch

from llmopt.stages.data import resolve_file

pytestmark = pytest.mark.integration
NEW_TOKENS, PROMPTS = 32, 10


def _prompts(tokenizer) -> list[list[int]]:
    records = json.loads(resolve_file("sharegpt").read_text())
    texts = [rec["conversations"][0]["value"] for rec in records[:PROMPTS]]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t[:400]}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)) for t in texts]


def _engine(ref):
    from llmopt.stages.serve.build import build_engine
    from llmopt.stages.serve.engine.config import EngineConfig

    return build_engine(str(ref), EngineConfig(block_size=16, num_blocks=512, max_num_seqs=16), dtype=torch.float32)


def _generate(engine, prompts):
    from llmopt.stages.serve.engine.config import SamplingParams

    return engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1))


def test_pipeline_stages_give_one_process_tokens(smollm_cache, tmp_path):
    from llmopt.stages.shard.config import ShardConfig
    from llmopt.stages.shard.run import run_shard

    one = _engine("smollm2-135m")
    prompts = _prompts(one.tokenizer)
    reference = _generate(one, prompts)
    for pp, tp in ((2, 1), (3, 1), (2, 2)):
        art = run_shard("smollm2-135m", tmp_path / f"pp{pp}-tp{tp}", ShardConfig(tp=tp, pp=pp))
        assert [len(s["ranks"]) for s in art.pipeline_parallel["stages"]] == [tp] * pp
        engine = _engine(art.path)
        try:
            assert engine.pipeline_depth == pp
            outputs = _generate(engine, prompts)
        finally:
            engine.runner.ranks.close()
        for ref, got in zip(reference, outputs, strict=True):
            assert got.token_ids == ref.token_ids, f"pp={pp} tp={tp}: {got.request_id}"
            assert max(abs(a.logprob - b.logprob) for a, b in zip(ref.logprobs, got.logprobs)) < 1e-4
