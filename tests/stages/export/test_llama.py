"""Which configs the Llama export covers, and its hyperparameters."""
import pytest

from llmopt.stages.errors import ConfigError
from llmopt.stages.export.llama import check_config, hparams, rotary_heads

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
         "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
         "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "vocab_size": 49152}


def test_smollm2_s_hyperparameters():
    check_config(LLAMA)
    assert hparams(LLAMA, 30, 1536, 49152) == {
        "context_length": 8192, "embedding_length": 576, "block_count": 30, "feed_forward_length": 1536,
        "head_count": 9, "head_count_kv": 3, "rope_freq_base": 100000.0, "layer_norm_rms_eps": 1e-5,
        "rope_dimension_count": 64, "vocab_size": 49152}
    assert hparams({**LLAMA, "head_dim": 128}, 30, 1536, 49152)["key_length"] == 128  # not hidden / heads


@pytest.mark.parametrize("change, says", [
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}, "Qwen2ForCausalLM is not supported yet"),
    ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}, "RoPE scaling 'llama3'"),
    ({"mlp_bias": True}, "MLP biases"),
    ({"attention_bias": True}, "attention biases"),
])
def test_what_llama_cpp_s_llama_cannot_hold_is_one_line(change, says):
    with pytest.raises(ConfigError, match=says):
        check_config({**LLAMA, **change})


def test_only_query_and_key_rows_are_reordered():
    assert rotary_heads("model.layers.3.self_attn.q_proj.weight", LLAMA) == 9
    assert rotary_heads("model.layers.3.self_attn.k_proj.bias", LLAMA) == 3
    assert rotary_heads("model.layers.3.self_attn.v_proj.weight", LLAMA) is None
