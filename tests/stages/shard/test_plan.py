"""The split plan: whole query heads per rank, the KV heads they read, group-aligned MLP cuts."""
import pytest

from llmopt.stages.errors import ConfigError
from llmopt.stages.shard.plan import (check_row_groups, even_split, head_assignment, make_plan, mlp_unit_for,
                                      row_split_points)

SMOLLM2 = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "intermediate_size": 1536,
           "vocab_size": 49152}


def test_even_split_covers_everything_in_whole_units():
    assert even_split(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert even_split(1152, 4, unit=64) == [(0, 320), (320, 640), (640, 896), (896, 1152)]


def test_smollm2_tp4_uneven_heads_replicate_one_kv_head():
    ranks = head_assignment(9, 3, 4)
    assert [r["q_heads"] for r in ranks] == [[0, 1, 2], [3, 4], [5, 6], [7, 8]]
    assert [r["kv_heads"] for r in ranks] == [[0], [1], [1, 2], [2]]  # KV head 1 lives on ranks 1 and 2
    assert [r["group"] for r in ranks] == [3, 2, 1, 2]
    for r in ranks:  # the local mapping j -> j // group reads the right global KV head
        assert [r["kv_heads"][j // r["group"]] for j in range(len(r["q_heads"]))] == [h // 3 for h in r["q_heads"]]


def test_uneven_kv_spread_falls_back_to_one_kv_copy_per_query_head():
    ranks = head_assignment(6, 2, 4)  # query heads [0,1] [2,3] [4] [5]; rank 1 reads KV 0 once and KV 1 once
    assert ranks[1] == {"q_heads": [2, 3], "kv_heads": [0, 1], "group": 1}
    ranks = head_assignment(8, 2, 3)  # [0,1,2] [3,4,5] [6,7]: rank 1 reads KV 0 once, KV 1 twice
    assert ranks[1] == {"q_heads": [3, 4, 5], "kv_heads": [0, 1, 1], "group": 1}


def test_even_split_keeps_gqa_groups():
    ranks = head_assignment(8, 4, 2)
    assert [r["kv_heads"] for r in ranks] == [[0, 1], [2, 3]] and {r["group"] for r in ranks} == {2}


def test_plan_ranges_and_cut_points():
    plan = make_plan(SMOLLM2, 4)
    assert [r["mlp"] for r in plan["ranks"]] == [[0, 384], [384, 768], [768, 1152], [1152, 1536]]
    assert plan["ranks"][-1]["vocab"] == [36864, 49152]
    assert row_split_points(plan, "o_proj") == [192, 320, 448]
    assert row_split_points(plan, "down_proj") == [384, 768, 1152]


def test_too_many_ranks_refused():
    with pytest.raises(ConfigError, match="--tp 10 exceeds the model's 9 query heads"):
        make_plan(SMOLLM2, 10)


def test_cut_quantization_group_refused_with_sizes_that_work():
    with pytest.raises(ConfigError) as e:
        check_row_groups("model.layers.0.self_attn.o_proj", 576, 128, [192, 320, 448], 4)
    message = str(e.value)
    assert "model.layers.0.self_attn.o_proj" in message and "group size 128" in message
    assert "--group-size 16 or 32 or 64" in message
    check_row_groups("model.layers.0.self_attn.o_proj", 576, 64, [192, 320, 448], 4)  # whole groups: fine


def test_mlp_unit_is_a_multiple_of_every_group():
    assert mlp_unit_for([]) == 1
    assert mlp_unit_for([32, 128, 8]) == 128
