"""The Llama family in llama.cpp's terms: which configs it covers, its hyperparameter keys, its tensor names and
which tensors take llama.cpp's query/key row order.

llama.cpp reads the `llama.*` keys below (gguf's `Keys.LLM` / `Keys.Attention` / `Keys.Rope`); transformers'
GGUF loader maps the same keys back onto a LlamaConfig (`GGUF_CONFIG_MAPPING["llama"]`).
"""
from __future__ import annotations

import re

from ..errors import ConfigError
from ..families import describe

ARCH = "llama"
ARCHITECTURES = ("LlamaForCausalLM",)
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def check_config(config: dict) -> None:
    """ConfigError for a config.json this export does not cover (another family, RoPE scaling, biases, windows)."""
    archs = config.get("architectures") or [config.get("model_type")]
    if archs[0] not in ARCHITECTURES and config.get("model_type") != ARCH:
        raise ConfigError(f"export: architecture {archs[0]} is not supported yet; GGUF export covers "
                          f"{', '.join(ARCHITECTURES)} (SmolLM2, Llama)")
    shape = describe(config)  # the activation, RoPE kinds and window our families understand
    if shape.activation != "silu":
        raise ConfigError(f"export: activation {shape.activation} is not llama.cpp's Llama MLP (silu)")
    scaling = shape.layers[0].rope.scaling_dict
    if scaling:
        raise ConfigError(f"export: RoPE scaling {scaling.get('rope_type', scaling.get('type'))!r} is not written "
                          "yet (llama.cpp needs rope_freqs or scaling keys that transformers' GGUF loader ignores)")
    if config.get("mlp_bias"):
        raise ConfigError("export: MLP biases (mlp_bias) have no tensors in llama.cpp's Llama")
    if config.get("attention_bias"):  # llama.cpp would read them; transformers' GGUF loader drops them silently
        raise ConfigError("export: attention biases (attention_bias) are not exported: transformers' GGUF loader "
                          "would drop them")
    if any(layer.window for layer in shape.layers):
        raise ConfigError("export: sliding-window attention is not llama.cpp's Llama")


def head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def hparams(config: dict, layers: int, intermediate: int, vocab: int) -> dict:
    """The `llama.*` keys (without the prefix) -> value, for GGUFWriter's typed adders (see `write_hparams`)."""
    heads = int(config["num_attention_heads"])
    keys = {"context_length": int(config.get("max_position_embeddings") or 2048),
            "embedding_length": int(config["hidden_size"]), "block_count": layers,
            "feed_forward_length": intermediate, "head_count": heads,
            "head_count_kv": int(config.get("num_key_value_heads") or heads),
            "rope_freq_base": describe(config).layers[0].rope.theta,
            "layer_norm_rms_eps": float(config.get("rms_norm_eps") or 1e-6),
            "rope_dimension_count": head_dim(config), "vocab_size": vocab}
    if head_dim(config) * heads != int(config["hidden_size"]):  # llama.cpp's default is hidden / heads
        keys["key_length"] = keys["value_length"] = head_dim(config)
    return keys


def write_hparams(writer, keys: dict) -> None:
    """Each key through GGUFWriter's own adder (`add_context_length`, ...), which types and prefixes it."""
    for key, value in keys.items():
        getattr(writer, f"add_{key}")(value)


def rotary_heads(name: str, config: dict) -> int | None:
    """The heads whose rows llama.cpp interleaves (`blocks.llama_rows`) for a query or key projection's
    tensor `name` (weight or bias), None for every other tensor."""
    if ".self_attn.q_proj." in name:
        return int(config["num_attention_heads"])
    if ".self_attn.k_proj." in name:
        return int(config.get("num_key_value_heads") or config["num_attention_heads"])
    return None


def layer_of(name: str) -> int | None:
    match = LAYER.match(name)
    return int(match.group(1)) if match else None


def tensor_names(layers: int):
    """A function: our tensor name (model.layers.0.self_attn.q_proj.weight) -> llama.cpp's (blk.0.attn_q.weight),
    from gguf's own name map; ConfigError for a tensor llama.cpp's Llama has no place for."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)

    def gguf_name(name: str) -> str:
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ConfigError(f"export: tensor {name} has no place in llama.cpp's Llama")
        return mapped

    return gguf_name
