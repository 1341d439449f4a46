"""Bytes and FLOPs of a step, checked against independent counts (HF parameters, torch's FLOP counter)."""
import torch
from torch.utils.flop_counter import FlopCounterMode

from llmopt.stages.model_io import load_model_dir
from llmopt.stages.profile.costs import (attention_flops, kv_bytes_per_token, parameter_count, prefill_flops,
                                         weight_bytes)
from llmopt.stages.serve.loader import load_runtime


def test_dense_weight_bytes_are_the_models_parameters_read_once(tiny_sources):
    runtime, _, _ = load_runtime(tiny_sources[0])
    model = load_model_dir(tiny_sources[0])
    params = list(model.parameters())  # the tied embedding / lm_head once
    assert weight_bytes(runtime)["total"] == sum(p.numel() * p.element_size() for p in params)
    assert parameter_count(runtime.spec) == sum(p.numel() for p in params)


def test_w4_layers_stream_about_five_bits_per_weight(tiny_sources):
    dense, _, _ = load_runtime(tiny_sources[0])
    w4, _, _ = load_runtime(tiny_sources[1])
    assert type(w4.layers[0].qkv).__name__ == "W4A16Linear"
    ratio = weight_bytes(w4)["decoder_layers"] / weight_bytes(dense)["decoder_layers"]
    # int4 codes are 1/8 of fp32; bf16 scale and zero per 32 weights add 1/32
    assert 1 / 8 < ratio < 1 / 8 + 1 / 16
    assert weight_bytes(w4)["lm_head"] == weight_bytes(dense)["lm_head"]  # the tied lm_head stays dense


def test_linear_flops_match_torchs_counter_on_the_hf_model(tiny_sources):
    model = load_model_dir(tiny_sources[0])
    runtime, _, _ = load_runtime(tiny_sources[0])
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids, logits_to_keep=1)
    matmuls = sum(n for op, n in counter.get_flop_counts()["Global"].items() if str(op) in ("aten.mm", "aten.addmm"))
    spec = runtime.spec
    assert prefill_flops(spec, 32) - attention_flops(spec, 32 * 33 // 2) == matmuls


def test_kv_bytes_per_token():
    from llmopt.stages.serve.model import spec_from_config

    spec = spec_from_config(dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                 num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3))
    assert kv_bytes_per_token(spec, torch.float32) == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv_bytes_per_token(spec, torch.bfloat16) == 23040
