"""`run_shard` with --pp: each rank's folder holds its stage's layers (numbered from 0) cut for its TP index,
the embedding on the first stage, the head (or the tied embedding's copy) on the last; quantized codes are moved,
never re-quantized."""
import warnings

import pytest
import torch

from llmopt.stages.artifact import Artifact, rank_dir
from llmopt.stages.errors import ConfigError
from llmopt.stages.safetensors_io import load_dir, weight_files
from llmopt.stages.shard.config import ShardConfig
from llmopt.stages.shard.run import run_shard
from tests.helpers import write_hf_dir

LAYERS = 7


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny 7-layer Llamas (4 query, 2 KV heads of 16): tied, untied, and W4A16 (rtn, groups of 16)."""
    from llmopt.stages.quantize.config import QuantizeConfig
    from llmopt.stages.quantize.run import run_quantize

    root = tmp_path_factory.mktemp("pp")
    write_hf_dir(root / "base", layers=LAYERS, hidden=64, heads=4, kv_heads=2)
    write_hf_dir(root / "untied", layers=LAYERS, hidden=64, heads=4, kv_heads=2, tie=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_quantize(str(root / "base"), root / "w4", QuantizeConfig(method="rtn", scheme="W4A16", group_size=16,
                                                                      eval_windows=0))
    return root


def source_state(path) -> dict:
    art = Artifact.open(path) if (path / "llmopt.json").exists() else None
    return load_dir(path, art.weight_files if art else weight_files(path))


def rank_state(art: Artifact, rank: int) -> dict:
    return load_dir(art.path, Artifact.open(art.path).rank_files(rank))


def global_name(name: str, first: int) -> str:
    """A stage's local layer name as the source names it (model.layers.1.x of a stage from layer 3: layer 4)."""
    if not name.startswith("model.layers."):
        return name
    index, rest = name[len("model.layers."):].split(".", 1)
    return f"model.layers.{int(index) + first}.{rest}"


def test_pp3_holds_each_stages_layers_renumbered(models):
    art = run_shard(str(models / "base"), models / "base-pp3", ShardConfig(pp=3), force=True)
    pipeline, source = art.pipeline_parallel, source_state(models / "base")
    assert sorted(p.name for p in art.path.glob("rank-*")) == [rank_dir(g) for g in range(3)] and art.world_size == 3
    assert [s["layers"] for s in pipeline["stages"]] == [[0, 2], [2, 5], [5, 7]]  # the head's copy weighs last
    assert pipeline["tied_lm_head_duplicated"] and pipeline["balance"] == "decode"
    assert art.tensor_parallel["tp"] == 1 and art.manifest["config"] == {"tp": 1, "pp": 3, "pp_layers": None,
                                                                         "pp_balance": "decode"}
    for stage in pipeline["stages"]:
        state = rank_state(art, stage["stage"])
        first, end = stage["layers"]
        layers = {int(n.split(".")[2]) for n in state if n.startswith("model.layers.")}
        assert layers == set(range(end - first))
        assert ("model.embed_tokens.weight" in state) == (stage["embed"] or stage["head"])  # the tied copy
        assert ("model.norm.weight" in state) == stage["head"] and "lm_head.weight" not in state
        for name, tensor in state.items():
            assert torch.equal(tensor, source[global_name(name, first)]), name
    metrics = art.manifest["metrics"]
    assert metrics["stage_bytes"] == metrics["rank_bytes"] and len(metrics["rank_bytes"]) == 3


def test_an_untied_head_goes_to_the_last_stage_only(models):
    art = run_shard(str(models / "untied"), models / "untied-pp2", ShardConfig(pp=2), force=True)
    assert not art.pipeline_parallel["tied_lm_head_duplicated"]
    first, last = rank_state(art, 0), rank_state(art, 1)
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first and "model.norm.weight" not in first
    assert "model.embed_tokens.weight" not in last and {"lm_head.weight", "model.norm.weight"} <= set(last)


def test_pp2_tp2_ranks_hold_the_tp_ranks_slices_of_their_layers(models):
    tp = run_shard(str(models / "base"), models / "base-tp2", ShardConfig(tp=2), force=True)
    art = run_shard(str(models / "base"), models / "base-pp2-tp2", ShardConfig(tp=2, pp=2), force=True)
    pipeline = art.pipeline_parallel
    assert art.world_size == 4 and [s["ranks"] for s in pipeline["stages"]] == [[0, 1], [2, 3]]
    assert art.tensor_parallel == tp.tensor_parallel
    for g in range(4):
        stage, t = pipeline["stages"][g // 2], g % 2
        state, whole = rank_state(art, g), rank_state(tp, t)
        first, end = stage["layers"]
        assert len([n for n in state if n.endswith("q_proj.weight")]) == end - first
        for name, tensor in state.items():
            assert torch.equal(tensor, whole[global_name(name, first)]), (g, name)
    assert art.manifest["metrics"]["stage_bytes"] == [sum(art.manifest["metrics"]["rank_bytes"][g] for g in s["ranks"])
                                                      for s in pipeline["stages"]]


@pytest.mark.parametrize("tp", [1, 2])
def test_w4a16_is_split_on_its_codes(models, tp):
    art = run_shard(str(models / "w4"), models / f"w4-pp2-tp{tp}", ShardConfig(tp=tp, pp=2), force=True)
    source = source_state(models / "w4")
    whole = run_shard(str(models / "w4"), models / f"w4-tp{tp}", ShardConfig(tp=tp), force=True)
    packed = 0
    for g in range(2 * tp):
        first = art.pipeline_parallel["stages"][g // tp]["layers"][0]
        reference = source if tp == 1 else rank_state(whole, g % tp)
        for name, tensor in rank_state(art, g).items():
            assert tensor.dtype == reference[global_name(name, first)].dtype
            assert torch.equal(tensor, reference[global_name(name, first)]), name
            packed += name.endswith(("weight_packed", "weight_scale"))
    assert packed == 2 * 7 * LAYERS * tp  # every Linear's codes and scales, on exactly one rank per TP index


def test_explicit_pp_layers(models):
    art = run_shard(str(models / "base"), models / "base-explicit", ShardConfig(pp=2, pp_layers="0,1-6"), force=True)
    pipeline = art.pipeline_parallel
    assert pipeline["balance"] == "explicit" and [s["layers"] for s in pipeline["stages"]] == [[0, 1], [1, 7]]
    assert art.manifest["config"] == {"tp": 1, "pp": 2, "pp_layers": "0,1-6"}


def test_pp1_writes_what_tp_alone_writes(models):
    old = run_shard(str(models / "base"), models / "base-tp2-old", ShardConfig(2), force=True)
    new = run_shard(str(models / "base"), models / "base-tp2-pp1", ShardConfig(tp=2, pp=1), force=True)
    assert new.content_hash == old.content_hash and new.manifest["config"] == {"tp": 2}
    assert new.pipeline_parallel is None and "stage_bytes" not in new.manifest["metrics"] and new.world_size == 2
    names = list(rank_state(new, 0))
    assert "model.layers.6.self_attn.q_proj.weight" in names and "model.embed_tokens.weight" in names


def test_bad_pipelines_are_refused_before_writing(models, tmp_path):
    with pytest.raises(ConfigError, match=r"--pp 8 exceeds the model's 7 decoder layers"):
        run_shard(str(models / "base"), tmp_path / "pp8", ShardConfig(pp=8))
    with pytest.raises(ConfigError, match=r"layer 3 is missing.*\(the model has 7 layers, 0-6\)"):
        run_shard(str(models / "base"), tmp_path / "gap", ShardConfig(pp=2, pp_layers="0-2,4-6"))
    assert not any(tmp_path.iterdir())


def test_a_sharded_artifact_is_not_sharded_again(models):
    art = run_shard(str(models / "base"), models / "base-pp2-again", ShardConfig(pp=2), force=True)
    with pytest.raises(ConfigError, match=r"already sharded for pipeline parallelism \(pp=2, tp=1\); shard its parent"):
        run_shard(str(art.path), models / "again", ShardConfig(pp=2))
