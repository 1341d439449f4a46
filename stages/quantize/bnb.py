"""bitsandbytes NF4 / LLM.int8 through transformers' integration, saved so transformers reloads it."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..artifact import ArtifactWriter, safetensors_bytes
from ..errors import ConfigError
from ..eval.before_after import perplexity, reusable_artifact, store_before_after
from ..model_io import model_info
from ..source import source_record


def bnb_config(scheme: str):
    from transformers import BitsAndBytesConfig

    if scheme == "NF4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False,
                                  bnb_4bit_compute_dtype=torch.bfloat16, llm_int8_skip_modules=["lm_head"])
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"])


def run_bnb(loaded, dest: Path, config, force: bool, hooks):
    """Re-load the source with a bitsandbytes quantization_config and save the result."""
    from transformers import AutoModelForCausalLM

    if loaded.artifact is None and loaded.source.kind != "hf":
        raise ConfigError("bnb needs a Hugging Face directory or an artifact as source")
    directory = loaded.artifact.path if loaded.artifact else loaded.source.path
    base = perplexity(loaded.model, loaded.tokenizer, config.eval_windows, hooks, "base",
                      reusable_artifact(loaded, config.dtype))
    hooks.status(f"bitsandbytes {config.scheme} on {config.device}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*MatMul8bitLt.*")
        model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=bnb_config(config.scheme),
                                                     device_map=config.device, dtype=torch.bfloat16)
    with ArtifactWriter(dest, force=force) as w:
        w.check_space(model.get_memory_footprint())
        model.save_pretrained(w.tmp)
        loaded.tokenizer.save_pretrained(w.tmp)
        info = model_info(loaded.model)
        art = w.commit("quantize", config.to_dict(), loaded.artifact, source_record(loaded.source, loaded.artifact),
                       model=info, metrics={"size_bytes": safetensors_bytes(w.tmp)})
    store_before_after(art, config.eval_windows, hooks, base, "quantized")
    return art
