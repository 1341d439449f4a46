"""What a GGUF file should hold, computed without the export's code: the artifact's dequantized weights
(compressed-tensors' codes times scales, fp32) and the GGUF's own, read back with gguf's reader and
dequantizer and put back in Hugging Face row order by transformers' own GGUF loader code."""
import json
from pathlib import Path

import numpy as np
import torch

from llmopt.stages.artifact import Artifact
from llmopt.stages.compressed import decompress_linear, dequantize_codes, parse_schemes
from llmopt.stages.safetensors_io import load_dir


def artifact_weights(path: Path) -> dict[str, np.ndarray]:
    """Our tensor name -> the weights the artifact stands for, fp32 (dense ones as stored)."""
    art = Artifact.open(path)
    state = load_dir(art.path, art.weight_files)
    config = json.loads((art.path / "config.json").read_text())
    out = {}
    qconfig = config.get("quantization_config")
    if qconfig:
        modules = sorted({k.rsplit(".", 1)[0] for k, t in state.items()
                          if k.endswith(".weight_packed") or (k.endswith(".weight") and t.dim() == 2)})
        embeddings = [m for m in modules if m.endswith("embed_tokens")]
        for m, scheme in parse_schemes(qconfig, [m for m in modules if m not in embeddings], embeddings).items():
            q, scale, zero = decompress_linear(state, m, scheme)
            out[f"{m}.weight"] = dequantize_codes(q, scale, zero, torch.float32).numpy()
            for suffix in ("weight", "weight_packed", "weight_scale", "weight_shape", "weight_zero_point"):
                state.pop(f"{m}.{suffix}", None)
    out.update({k: t.float().numpy() for k, t in state.items()})
    return out


def gguf_weights(path, config: dict) -> dict[str, tuple[str, np.ndarray]]:
    """Our tensor name -> (GGUF type name, the GGUF's dequantized weights in Hugging Face row order), from a
    file or a gguf.GGUFReader of it."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    ours = {names.get_name(k, try_suffixes=(".weight", ".bias")): k for k in _hf_names(layers)}
    unpermute = LlamaTensorProcessor(config={"num_attention_heads": config["num_attention_heads"],
                                             "num_key_value_heads": config["num_key_value_heads"]})
    out = {}
    for t in _reader(path).tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        out[ours[t.name]] = (t.tensor_type.name, unpermute.process(w, t.name).weights)
    return out


def _hf_names(layers: int) -> list[str]:
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
    return (["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
            + [f"model.layers.{i}.{p}.weight" for i in range(layers) for p in per_layer])


def gguf_fields(path) -> dict:
    """Every metadata key -> its value, from a file or a gguf.GGUFReader of it."""
    return {k: f.contents() for k, f in _reader(path).fields.items() if not k.startswith("GGUF.")}


def _reader(path):
    import gguf

    return path if isinstance(path, gguf.GGUFReader) else gguf.GGUFReader(path)
