"""bitsandbytes NF4 / LLM.int8 through transformers' integration, saved so transformers reloads it."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..artifact import ArtifactWriter
from ..errors import ConfigError
from ..importer import model_info


def bnb_config(scheme: str):
    from transformers import BitsAndBytesConfig

    if scheme == "NF4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False,
                                  bnb_4bit_compute_dtype=torch.bfloat16, llm_int8_skip_modules=["lm_head"])
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"])


def run_bnb(loaded, dest: Path, config, force: bool, hooks):
    """Re-load the source with a bitsandbytes quantization_config and save the result."""
    from transformers import AutoModelForCausalLM

    from .run import _evaluate_written, _eval, _source, _weights_bytes

    if loaded.artifact is None and loaded.source.kind != "hf":
        raise ConfigError("bnb needs a Hugging Face directory or an artifact as source")
    directory = loaded.artifact.path if loaded.artifact else loaded.source.path
    base = _eval(loaded.model, loaded.tokenizer, config, hooks, "base", loaded.artifact)
    hooks.status(f"bitsandbytes {config.scheme} on {config.device}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*MatMul8bitLt.*")
        model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=bnb_config(config.scheme),
                                                     device_map=config.device, dtype=torch.bfloat16)
    with ArtifactWriter(dest, force=force) as w:
        model.save_pretrained(w.tmp)
        loaded.tokenizer.save_pretrained(w.tmp)
        info = model_info(loaded.model)
        art = w.commit("quantize", config.to_dict(), loaded.artifact, _source(loaded), model=info,
                       metrics={"size_bytes": _weights_bytes(w.tmp)})
    _evaluate_written(art, config, hooks, base)
    return art
