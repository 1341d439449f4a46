"""Tensor-parallel serving on CPU over gloo: the same greedy tokens (and logprobs) as one process,
for even and uneven head splits, dense and W4A16 (also with an int8 embedding), through the real rank processes."""
import warnings

import pytest
import torch

from llmopt.stages.artifact import Artifact
from llmopt.stages.errors import ConfigError, SourceError
from llmopt.stages.serve.build import build_engine
from llmopt.stages.serve.engine.config import EngineConfig, SamplingParams
from llmopt.stages.shard.config import ShardConfig
from llmopt.stages.shard.run import run_shard
from llmopt.stages.source import load
from tests.helpers import write_hf_dir

PROMPTS = ["the quick brown fox", "a language model predicts", "pack the weights", "twelve small layers of"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama with 6 query and 2 KV heads (head_dim 16): --tp 4 splits its heads 2,2,1,1."""
    from llmopt.stages.quantize.config import QuantizeConfig
    from llmopt.stages.quantize.run import run_quantize

    root = tmp_path_factory.mktemp("tp")
    write_hf_dir(root / "base", hidden=96, heads=6, kv_heads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_quantize(str(root / "base"), root / "w4", QuantizeConfig(method="rtn", scheme="W4A16", group_size=16,
                                                                      eval_windows=0))
        # int8 embedding (groups of 32) and tied lm_head: vocab-parallel on its codes
        run_quantize(str(root / "base"), root / "w4-emb8", QuantizeConfig(method="rtn", scheme="W4A16", group_size=16,
                                                                           eval_windows=0, embeddings="int8"))
    return root


def generate(ref) -> list:
    engine = build_engine(str(ref), EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4), "cpu",
                          torch.float32, backend="reference")
    try:
        return engine.generate(PROMPTS, GREEDY)
    finally:
        ranks = getattr(engine.runner, "ranks", None)
        if ranks is not None:
            ranks.close()


@pytest.mark.parametrize("name", ["base", "w4", "w4-emb8"])
def test_tp2_and_tp4_match_one_process(models, name):
    reference = generate(models / name)
    for tp in (2, 4):
        art = run_shard(str(models / name), models / f"{name}-tp{tp}", ShardConfig(tp), force=True)
        outputs = generate(art.path)
        for ref, got in zip(reference, outputs):
            assert got.token_ids == ref.token_ids, f"tp={tp}"
            for a, b in zip(ref.logprobs, got.logprobs):
                assert abs(a.logprob - b.logprob) < 1e-4


def test_rank_folders_hold_their_share(models):
    art = run_shard(str(models / "base"), models / "base-tp2-sizes", ShardConfig(2), force=True)
    shares = art.manifest["metrics"]["rank_share"]
    assert len(shares) == 2 and all(0.45 < s < 0.6 for s in shares)  # KV heads and norms are replicated
    assert Artifact.open(art.path).rank_files(1) == ["rank-01/model.safetensors"]
    assert art.tensor_parallel["ranks"][1]["q_heads"] == [3, 4, 5]


def test_int8_embedding_is_split_on_its_codes(models):
    from llmopt.stages.safetensors_io import load_dir

    art = run_shard(str(models / "w4-emb8"), models / "w4-emb8-tp2-files", ShardConfig(2), force=True)
    for rank, plan in enumerate(art.tensor_parallel["ranks"]):
        state = load_dir(art.path, Artifact.open(art.path).rank_files(rank))
        v0, v1 = plan["vocab"]
        assert "model.embed_tokens.weight" not in state and "lm_head.weight" not in state
        assert state["model.embed_tokens.weight_shape"].tolist() == [v1 - v0, 96]
        assert state["model.embed_tokens.weight_scale"].shape == (v1 - v0, 3)


def test_group_cut_refused_before_writing(models, tmp_path):
    from llmopt.stages.quantize.config import QuantizeConfig
    from llmopt.stages.quantize.run import run_quantize

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_quantize(str(models / "base"), tmp_path / "g32", QuantizeConfig(method="rtn", scheme="W4A16",
                                                                             group_size=32, eval_windows=0))
    with pytest.raises(ConfigError, match=r"o_proj: its 96 inputs split at 32, 64, 80.*--group-size 16"):
        run_shard(str(tmp_path / "g32"), tmp_path / "g32-tp4", ShardConfig(4))
    assert not (tmp_path / "g32-tp4").exists()


def test_sharded_artifact_is_refused_by_whole_model_stages(models):
    art = run_shard(str(models / "base"), models / "base-tp2-refuse", ShardConfig(2), force=True)
    with pytest.raises(SourceError, match="sharded for tensor parallelism"):
        load(str(art.path))
    with pytest.raises(ConfigError, match="already sharded"):
        run_shard(str(art.path), models / "again", ShardConfig(2))
