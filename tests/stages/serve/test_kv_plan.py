"""The KV cache's size and the start-up line that says where it came from (`build.kv_cache_plan`)."""
import logging
from types import SimpleNamespace

import pytest
import torch

from llmopt.stages.errors import ConfigError
from llmopt.stages.serve.build import kv_cache_plan
from llmopt.stages.serve.engine.config import EngineConfig

# SmolLM2-135M's cache shape: 30 layers x 3 KV heads x 64 dims, keys and values: 11,520 elements a token
# SmolLM2's cache shape: one KV layer group of all 30 layers (stages/families.py KVGroups)
SPEC = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, max_positions=8192,
                       shape=SimpleNamespace(kv=SimpleNamespace(size=30, count=1)))


def runtime(dtype=torch.bfloat16):
    return SimpleNamespace(spec=SPEC, dtype=dtype, device=torch.device("cpu"))


def test_max_model_len_times_max_num_seqs_and_the_start_up_line(caplog):
    with caplog.at_level(logging.INFO, logger="llmopt.serve"):
        plan = kv_cache_plan(EngineConfig(max_model_len=2048, max_num_seqs=16), SPEC, runtime())
    assert plan.num_blocks == 2048 and plan.tokens == 32768 and plan.bytes == 32768 * 11520 * 2
    line = "KV cache: 32,768 tokens (2,048 x 16 seqs, from --max-model-len x --max-num-seqs), 720 MiB bf16"
    assert plan.describe() == line and line in caplog.messages


def test_layer_groups_size_blocks_by_their_layers_and_hold_every_groups_prompt():
    """Gemma 3 270M's cache: 6 KV layer groups of 3 layers (1 KV head of 256): a block is 3 layers' worth, and
    a sequence at its longest holds a block per group (its whole prompt in each at admission)."""
    gemma = SimpleNamespace(num_layers=18, num_kv_heads=1, head_dim=256, max_positions=32768,
                            shape=SimpleNamespace(kv=SimpleNamespace(size=3, count=6)))
    plan = kv_cache_plan(EngineConfig(max_model_len=1024, max_num_seqs=4), gemma, runtime(), announce=False)
    assert plan.block_bytes == 2 * 3 * 16 * 256 * 2 and plan.num_blocks == 4 * 6 * 64
    assert plan.tokens == 4 * 1024 and plan.bytes == plan.num_blocks * plan.block_bytes


def test_a_partial_block_rounds_up_and_max_batch_size_caps_the_seqs():
    plan = kv_cache_plan(EngineConfig(max_model_len=100, max_num_seqs=8, max_batch_size=4, block_size=16), SPEC,
                         runtime(torch.float32), announce=False)
    assert plan.num_blocks == 4 * 7 and plan.block_bytes == 16 * 11520 * 4 and "100 x 4 seqs" in plan.source


def test_kv_cache_memory_wins_and_is_capped_at_what_the_seqs_can_use():
    block = 16 * 11520 * 2
    plan = kv_cache_plan(EngineConfig(kv_cache_memory=str(10 * block + 5), max_model_len=2048), SPEC, runtime(),
                         announce=False)
    assert plan.num_blocks == 10 and plan.source == f"from --kv-cache-memory {10 * block + 5}"
    capped = kv_cache_plan(EngineConfig(kv_cache_memory="1GiB", max_model_len=64, max_num_seqs=2), SPEC, runtime(),
                           announce=False)
    assert capped.num_blocks == 8 and capped.source == "from --kv-cache-memory 1GiB, capped at 64 x 2 seqs"


def test_num_blocks_as_given_and_the_default_otherwise():
    assert kv_cache_plan(EngineConfig(num_blocks=3), SPEC, runtime(), announce=False).num_blocks == 3
    plan = kv_cache_plan(EngineConfig(), SPEC, runtime(), announce=False)
    assert plan.num_blocks == (2 << 30) // (16 * 11520 * 2) and plan.source.startswith("the default 2GiB")


def test_too_little_memory_is_a_config_error():
    with pytest.raises(ConfigError, match="hold no cache block"):
        kv_cache_plan(EngineConfig(kv_cache_memory="1KiB"), SPEC, runtime(), announce=False)
