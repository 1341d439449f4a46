"""The pipeline stage plan: --pp-layers parsing, balancing layers by bytes, the manifest entry, a stage's config."""
import pytest

from llmopt.stages.errors import ConfigError
from llmopt.stages.shard.config import ShardConfig
from llmopt.stages.shard.pipeline import (balance_layers, check_kv_groups, make_pipeline_plan, parse_pp_layers,
                                          plan_stages, stage_config, stage_of_rank, stored_bytes, tp_index)

LLAMA = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "num_attention_heads": 4,
         "hidden_size": 64, "intermediate_size": 128, "vocab_size": 300}


def test_pp_layers_are_inclusive_ranges():
    assert parse_pp_layers("0-9,10-19,20-29", 30) == [(0, 10), (10, 20), (20, 30)]
    assert parse_pp_layers(" 0-3 , 4 ,5-6", 7, pp=3) == [(0, 4), (4, 5), (5, 7)]  # "4": one layer
    assert parse_pp_layers("0-6", 7, pp=1) == [(0, 7)]


@pytest.mark.parametrize("text, problem", [
    ("0-9,11-29", "layer 10 is missing"),
    ("0-9,9-29", "layer 9 is listed twice"),
    ("1-29", "layer 0 is missing"),
    ("0-28", "layer 29 is missing"),
    ("0-9,10-27", "layers 28-29 are missing"),
    ("0-30", "there is no layer 30"),
    ("0-9;10-29", "is not a layer range such as 0-9"),
    ("0-9,,10-29", "'' is not a layer range"),
    ("9-0,10-29", "range 9-0 runs backwards"),
    ("0-14,15-29", "lists 2 stages but --pp is 3"),
])
def test_bad_pp_layers_name_the_problem_and_the_layer_count(text, problem):
    with pytest.raises(ConfigError) as e:
        parse_pp_layers(text, 30, pp=3 if "15-29" in text else None)
    message = str(e.value)
    assert problem in message and "(the model has 30 layers, 0-29)" in message and "\n" not in message


def test_balance_uneven_layers_later_stages_take_the_extra():
    assert balance_layers([1] * 7, 3, 0, 0) == [(0, 2), (2, 4), (4, 7)]
    assert balance_layers([1] * 6, 3, 0, 0) == [(0, 2), (2, 4), (4, 6)]


def test_balance_minimizes_the_largest_stage():
    assert balance_layers([5, 1, 1, 1, 1, 1], 2, 0, 0) == [(0, 1), (1, 6)]  # 5 | 5
    assert balance_layers([1, 1, 1, 1, 1, 9], 2, 0, 0) == [(0, 5), (5, 6)]  # 5 | 9


def test_a_heavy_embedding_pushes_layers_off_stage_0():
    assert balance_layers([1] * 7, 2, 0, 0) == [(0, 3), (3, 7)]
    assert balance_layers([1] * 7, 2, 5, 0) == [(0, 1), (1, 7)]  # 5 + 1 | 6
    assert balance_layers([1] * 7, 2, 0, 5) == [(0, 6), (6, 7)]  # the head weighs on the last stage
    # the largest stage is fixed by the head; the others are spread evenly, not piled onto one
    assert balance_layers([1] * 9, 3, 0, 20) == [(0, 4), (4, 8), (8, 9)]


def test_one_layer_per_stage_and_too_many_stages():
    assert balance_layers([3, 1, 2], 3, 10, 10) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ConfigError, match=r"--pp 4 exceeds the model's 3 decoder layers.*choose --pp <= 3"):
        balance_layers([1, 1, 1], 4, 0, 0)


def test_balance_is_exact_against_every_split():
    from itertools import combinations

    layer_bytes, first, last = [7, 3, 9, 1, 4, 8, 2, 6], 5, 11
    best = min(max(sum(layer_bytes[a:b]) + first * (s == 0) + last * (s == 2)
                   for s, (a, b) in enumerate(zip((0, *cuts), (*cuts, 8))))
               for cuts in combinations(range(1, 8), 2))
    ranges = balance_layers(layer_bytes, 3, first, last)
    got = [sum(layer_bytes[a:b]) + first * (s == 0) + last * (s == 2) for s, (a, b) in enumerate(ranges)]
    assert max(got) == best and ranges[0][0] == 0 and ranges[-1][1] == 8


def test_stored_bytes_weigh_layers_embedding_and_head():
    sizes = {"model.embed_tokens.weight": 100, "model.layers.0.mlp.down_proj.weight": 10,
             "model.layers.0.input_layernorm.weight": 1, "model.layers.1.self_attn.q_proj.weight_packed": 7,
             "model.norm.weight": 2, "lm_head.weight": 50}
    assert stored_bytes(sizes, 2, duplicate_embedding=False) == ([11, 7], 100, 52)
    tied = {k: v for k, v in sizes.items() if k != "lm_head.weight"}
    assert stored_bytes(tied, 2, duplicate_embedding=True) == ([11, 7], 100, 102)


def test_the_plan_in_the_manifest():
    plan = make_pipeline_plan(dict(LLAMA, tie_word_embeddings=True), [(0, 15), (15, 30)], 1, [123, 456], "decode")
    assert plan == {"pp": 2, "tp": 1, "world_size": 2, "num_layers": 30, "balance": "decode",
                    "stages": [{"stage": 0, "layers": [0, 15], "embed": True, "head": False, "ranks": [0], "bytes": 123},
                               {"stage": 1, "layers": [15, 30], "embed": False, "head": True, "ranks": [1],
                                "bytes": 456}],
                    "tied_lm_head_duplicated": True}
    untied = make_pipeline_plan(LLAMA, [(0, 10), (10, 20), (20, 30)], 2, [1, 2, 3], "explicit")
    assert [s["ranks"] for s in untied["stages"]] == [[0, 1], [2, 3], [4, 5]] and untied["world_size"] == 6
    assert untied["tied_lm_head_duplicated"] is False
    assert [stage_of_rank(untied, g)["stage"] for g in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [tp_index(untied, g) for g in range(6)] == [0, 1, 0, 1, 0, 1]
    with pytest.raises(ValueError):
        stage_of_rank(untied, 6)


def test_plan_stages_balances_or_takes_the_given_layers():
    sizes = {f"model.layers.{i}.mlp.down_proj.weight": 10 for i in range(30)}
    sizes.update({"model.embed_tokens.weight": 40, "model.norm.weight": 1})  # tied: no lm_head
    plan = plan_stages(LLAMA, sizes, tp=1, pp=2, pp_layers=None, tied=True)  # decode: what a step reads
    assert plan["balance"] == "decode" and plan["tied_lm_head_duplicated"]
    assert [s["layers"] for s in plan["stages"]] == [[0, 17], [17, 30]]  # the embedding is a gather: 170 vs 171 read
    assert [s["bytes"] for s in plan["stages"]] == [210, 171]  # what each stage stores
    memory = plan_stages(LLAMA, sizes, tp=1, pp=2, pp_layers=None, tied=True, balance="memory")
    assert memory["balance"] == "memory" and [s["layers"] for s in memory["stages"]] == [[0, 15], [15, 30]]
    assert [s["bytes"] for s in memory["stages"]] == [190, 191]  # the copy weighs as much as the embedding
    with pytest.raises(ConfigError, match="--pp-balance 'time'"):
        plan_stages(LLAMA, sizes, tp=1, pp=2, pp_layers=None, tied=True, balance="time")
    given = plan_stages(LLAMA, sizes, tp=2, pp=3, pp_layers="0-9,10-19,20-29", tied=True)
    assert given["balance"] == "explicit" and [s["layers"][0] for s in given["stages"]] == [0, 10, 20]


def test_stage_config_slices_the_layers():
    config = dict(LLAMA, layer_types=["sliding_attention", "full_attention"] * 15)
    stage = {"stage": 1, "layers": [15, 30], "embed": False, "head": True, "ranks": [1], "bytes": 0}
    local = stage_config(config, stage)
    assert local["num_hidden_layers"] == 15 and local["layer_types"] == config["layer_types"][15:30]
    assert local["llmopt_stage"] == {"stage": 1, "layers": [15, 30], "embed": False, "head": True}
    assert config["num_hidden_layers"] == 30 and "llmopt_stage" not in config  # the model's own is unchanged
    assert "layer_types" not in stage_config(LLAMA, stage)


def test_several_kv_groups_are_refused():
    gemma = {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6, "num_attention_heads": 4,
             "hidden_size": 64, "sliding_window": 16,
             "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    with pytest.raises(ConfigError, match=r"--pp 2: .*several KV layer groups.*not supported yet; use --tp"):
        check_kv_groups(gemma, 2)
    check_kv_groups(gemma, 1)
    check_kv_groups(LLAMA, 2)


def test_config_defaults_validation_and_dict():
    assert ShardConfig(2).to_dict() == {"tp": 2}  # as before --pp: old recipes and artifacts keep their config
    assert ShardConfig().to_dict() == {"tp": 1}
    assert ShardConfig(1, 3).to_dict() == {"tp": 1, "pp": 3, "pp_layers": None, "pp_balance": "decode"}
    assert ShardConfig(pp=2, pp_layers="0-3,4-6").to_dict() == {"tp": 1, "pp": 2, "pp_layers": "0-3,4-6"}
    assert ShardConfig(pp=2, pp_balance="memory").to_dict()["pp_balance"] == "memory"
    ShardConfig(tp=2, pp=2, pp_layers="0-3,4-6").validate()


@pytest.mark.parametrize("config, message", [
    (ShardConfig(tp=0), "--tp must be a positive integer (got 0)"),
    (ShardConfig(pp=-1), "--pp must be a positive integer (got -1)"),
    (ShardConfig(pp=True), "--pp must be a positive integer (got True)"),
    (ShardConfig(pp_layers="0-3,4-6"), "--pp-layers 0-3,4-6 lists 2 stages but --pp is 1; pass --pp 2"),
    (ShardConfig(pp=2, pp_layers="0-3,x"), "'x' is not a layer range"),
    (ShardConfig(pp=2, pp_balance="time"), "--pp-balance 'time': use one of decode, memory"),
])
def test_bad_config_is_one_line(config, message):
    with pytest.raises(ConfigError) as e:
        config.validate()
    assert message in str(e.value) and "\n" not in str(e.value)
