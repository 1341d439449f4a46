"""Tiny random-weight models of every family in stages/families.py, built with transformers' own classes
(2 layers, hidden 64, 4 query / 2 KV heads of 16, vocabulary 300), for the stages' per-family tests."""
from __future__ import annotations

from pathlib import Path

import torch

FAMILY_NAMES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")


def family_config(name: str, vocab_size: int = 300, layers: int = 2, tie: bool = False):
    """A transformers config of family `name`: Mistral with a sliding window shorter than the calibration
    windows, Gemma 3 with one sliding and one full layer."""
    from transformers import (Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                              Qwen3Config)

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  tie_word_embeddings=tie, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    if name == "llama":
        return LlamaConfig(**common)
    if name == "mistral":
        return MistralConfig(**common, sliding_window=16)
    if name == "qwen2":
        return Qwen2Config(**common)
    if name == "qwen3":
        return Qwen3Config(**common)
    if name == "phi3":
        return Phi3Config(**{k: v for k, v in common.items() if k != "head_dim"})
    if name == "gemma3":
        types = ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2)
        return Gemma3TextConfig(**common, sliding_window=16, layer_types=types, architectures=["Gemma3ForCausalLM"])
    raise ValueError(f"no tiny config for family {name}")


def make_family_model(name: str, vocab_size: int = 300, seed: int = 0, layers: int = 2, tie: bool = False):
    """The model, its weights widened so logits differ (matrices N(0, 0.3)) and every norm weight moved off
    its initial value (Gemma's zeros included), so a wrongly folded or dropped norm shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(name, vocab_size, layers, tie)).eval()
    model.config.architectures = [type(model).__name__]
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
            else:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def write_family_dir(path: Path, name: str, seed: int = 0, layers: int = 2, tie: bool = False):
    """(model, tokenizer) saved as a plain HF directory at `path`."""
    from tests.helpers import make_tokenizer

    tok = make_tokenizer()
    model = make_family_model(name, len(tok), seed, layers, tie)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def write_family_dirs(root: Path, seed: int, tied: tuple[str, ...] = ()) -> dict:
    """{family: (directory, model)}: every family's tiny model saved under `root` (those in `tied` with a tied
    embedding), for a test module's `sources` fixture."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: (root / name, write_family_dir(root / name, name, seed=seed, tie=name in tied)[0])
                for name in FAMILY_NAMES}
