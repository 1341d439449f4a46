"""The capacity planner and the sweep plan: pure arithmetic, checked against numbers worked by hand."""
import pytest
import torch

from llmopt.stages.errors import ConfigError
from llmopt.stages.profile.capacity import PlanInputs, plan_capacity, recommend
from llmopt.stages.profile.config import ProfileConfig
from llmopt.stages.profile.plan import plan_sweep
from llmopt.stages.profile.tables import capacity_table
from llmopt.stages.serve.model import spec_from_config

MIB = 1 << 20
CONFIG = dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _inputs(**overrides) -> PlanInputs:
    base = dict(budget_bytes=1000 * MIB, weights_bytes=300 * MIB, overhead_bytes=100 * MIB, kv_bytes_per_token=1000,
                block_size=16, context=1000, decode=((1, 10.0), (4, 20.0), (16, 50.0)), decode_context=1000,
                ms_per_context_token=0.0)
    return PlanInputs(**{**base, **overrides})


def test_fit_counts_whole_blocks_per_sequence():
    plan = plan_capacity(_inputs())
    assert plan["kv_bytes_per_seq"] == 63 * 16 * 1000  # ceil(1000 / 16) blocks of 16 tokens
    assert plan["max_num_seqs_fit"] == (600 * MIB) // (63 * 16 * 1000) == 624
    assert [r["tokens_per_s"] for r in plan["tradeoff"]] == pytest.approx([100.0, 200.0, 320.0])


def test_tpot_is_extrapolated_to_the_plan_context_per_sequence():
    plan = plan_capacity(_inputs(context=2000, ms_per_context_token=0.001))
    # 1000 more tokens per sequence at 1 us each: +1 ms per sequence in the batch
    assert [r["tpot_ms"] for r in plan["tradeoff"]] == pytest.approx([11.0, 24.0, 66.0])


def test_recommendation_interpolates_under_the_target_and_respects_memory():
    assert plan_capacity(_inputs(target_tpot_ms=30.0))["recommended_max_num_seqs"] == 8  # 4 + 12 * (10 / 30)
    tight = plan_capacity(_inputs(target_tpot_ms=30.0, budget_bytes=400 * MIB + 6 * 63 * 16 * 1000))
    assert tight["max_num_seqs_fit"] == 6 and tight["recommended_max_num_seqs"] == 6
    assert "memory" in tight["reason"]
    assert plan_capacity(_inputs(target_tpot_ms=5.0))["recommended_max_num_seqs"] is None
    assert plan_capacity(_inputs(target_tpot_ms=500.0))["recommended_max_num_seqs"] == 16


def test_without_a_target_the_best_fitting_throughput_wins():
    rows = [{"batch": 1, "tpot_ms": 10.0, "tokens_per_s": 100.0, "fits": True},
            {"batch": 4, "tpot_ms": 20.0, "tokens_per_s": 200.0, "fits": True},
            {"batch": 16, "tpot_ms": 50.0, "tokens_per_s": 320.0, "fits": False}]
    assert recommend(rows, 4, None)[0] == 4
    assert recommend([dict(r, fits=False) for r in rows], 0, None)[0] is None


def test_sweep_plan_skips_what_does_not_fit_and_says_so():
    spec = spec_from_config(CONFIG)
    config = ProfileConfig(prompt_lens=(64, 512), batch_sizes=(1, 8, 64), context_lens=(128, 300),
                           decode_context=128, block_size=16, plan_context=4096)
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # k and v, layers, tokens, kv heads, head dim, fp32
    plan = plan_sweep(config, spec, torch.float32, free_bytes=2 * 8 * 8 * per_block)  # half: 64 blocks
    assert plan.prompt_lens == (64,) and plan.context_lens == (128,) and plan.batch_sizes == (1, 8)
    assert plan.num_blocks == 64 and plan.plan_context == 256
    assert any("prompt length 512" in s for s in plan.skipped) and any("batch 64" in s for s in plan.skipped)
    with pytest.raises(ConfigError, match="KV cache"):
        plan_sweep(config, spec, torch.float32, free_bytes=per_block)


# The noisy sweep of issue 27: batch 4 took 2,143 ms per step, batch 16 1,105 ms.
NOISY = ((1, 400.0), (4, 2143.0), (16, 1105.0))


def test_a_sweep_that_drops_beyond_its_noise_is_flagged_and_recommends_nothing():
    spread = ((1, 390.0, 420.0), (4, 2100.0, 2200.0), (16, 1090.0, 1130.0))
    for target in (None, 5000.0):
        plan = plan_capacity(_inputs(decode=NOISY, decode_spread=spread, target_tpot_ms=target))
        assert plan["recommended_max_num_seqs"] is None and not plan["monotone"]
        assert "not monotone" in plan["reason"]
        assert plan["sweep_problems"] == ["batch 4 (2,100.00 ms at its fastest) is slower than batch 16 "
                                          "(1,130.00 ms at its slowest)"]
        assert [(r["measured_ms_min"], r["measured_ms_max"]) for r in plan["tradeoff"]] == [s[1:] for s in spread]
        note = capacity_table({"source": "m", "capacity": plan}).note
        assert "--max-num-seqs" in note and "none" in note and "batch 4 (2,100.00 ms" in note


def test_a_drop_within_the_spread_still_recommends():
    spread = ((1, 390.0, 420.0), (4, 1000.0, 2200.0), (16, 1090.0, 1130.0))  # batch 4's fastest under 16's slowest
    plan = plan_capacity(_inputs(decode=NOISY, decode_spread=spread))
    assert plan["monotone"] and plan["sweep_problems"] == []
    assert plan["recommended_max_num_seqs"] == 16


def test_without_a_spread_each_point_is_its_own_range():
    plan = plan_capacity(_inputs(decode=NOISY))
    assert plan["recommended_max_num_seqs"] is None and len(plan["sweep_problems"]) == 1
    assert plan_capacity(_inputs())["monotone"]
