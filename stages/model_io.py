"""Saving and loading Hugging Face causal LMs as plain directories (safetensors only).

Loading builds the model on the meta device and assigns tensors memory-mapped from the safetensors
files, so a model is never materialised twice (no random init, no copy) unless a dtype change
requires one.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
from pathlib import Path

import torch

from .artifact import SHARD_BYTES
from .errors import ArtifactError, SourceError
from .safetensors_io import load_dir, save_state_dict, weight_files

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name in (None, "auto"):
        return None
    if name not in DTYPES:
        from .errors import ConfigError

        raise ConfigError(f"unknown dtype '{name}'; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def clean_config(config):
    """A copy of `config` describing dense weights: no GGUF loader, no compressed-tensors layout.

    (A model loaded from a compressed artifact holds dequantized weights; saved, it is dense.)
    """
    config = copy.deepcopy(config)
    qc = getattr(config, "quantization_config", None)
    if qc is not None and _quant_method(qc) in ("gguf", "compressed-tensors"):
        del config.quantization_config
    return config


def _quant_method(qc) -> str:
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", "")
    return str(getattr(method, "value", method))


def save_model(model, tokenizer, directory: Path, max_shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write config, generation config, tokenizer and safetensors weights into `directory`."""
    save_model_files(model, tokenizer, directory)
    return save_state_dict(model.state_dict(), directory, max_shard_bytes)


def save_model_files(model, tokenizer, directory: Path, quantization_config: dict | None = None) -> None:
    """Everything but the weights: config.json (with `quantization_config` if given), generation
    config, tokenizer."""
    config = clean_config(model.config)
    config.dtype = next(model.parameters()).dtype
    if quantization_config is not None:
        config.quantization_config = quantization_config
    if not getattr(config, "architectures", None):  # GGUF-loaded configs lack it; vLLM needs it
        config.architectures = [type(model).__name__]
    config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def load_config(directory: Path):
    from transformers import AutoConfig

    if not (directory / "config.json").is_file():
        raise SourceError(f"{directory}: no config.json; not a Hugging Face model directory")
    try:
        return AutoConfig.from_pretrained(directory)
    except (ValueError, KeyError, OSError) as e:
        raise SourceError(f"{directory}/config.json: cannot be read ({str(e).splitlines()[0]})") from None


def load_model_dir(directory: Path, dtype: torch.dtype | None = None, files: list[str] | None = None):
    """Build the model from `config.json` on meta, then assign mmap'd safetensors weights."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    config = load_config(directory)
    files = files if files is not None else weight_files(directory)
    if not files:
        raise SourceError(f"{directory}: no safetensors weights (llmopt loads safetensors only, never pickle)")
    state = load_dir(directory, files)
    qconfig = _quantization_config(config)
    if qconfig is not None and qconfig.get("quant_method") == "bitsandbytes":
        return _load_bnb(directory)
    target = dtype or _stored_dtype(state)
    bare = clean_config(config)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(bare, dtype=target)
    if qconfig is not None:  # the loaded model still says what it was made from
        model.config.quantization_config = qconfig
    if qconfig is not None:
        from .compressed import materialize

        state = materialize(model, state, qconfig, target)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys:
        raise ArtifactError(f"{directory}: weights not in the model: {', '.join(result.unexpected_keys[:5])}")
    model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if still_meta:
        raise ArtifactError(f"{directory}: weights missing from the safetensors files: {', '.join(still_meta[:5])}")
    model.config.dtype = target
    return model.eval()


def _quantization_config(config) -> dict | None:
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    return qc if isinstance(qc, dict) else qc.to_dict()


def _stored_dtype(state: dict) -> torch.dtype:
    """The dtype of the dense floating tensors (scales aside, they are float32 by convention)."""
    for name, t in state.items():
        if t.is_floating_point() and not name.endswith(("_scale", "_zero_point")):
            return t.dtype
    return torch.float32


def _load_bnb(directory: Path):
    """bitsandbytes artifacts load through transformers' own integration."""
    import warnings

    from transformers import AutoModelForCausalLM

    # bitsandbytes' CPU int8 path warns on every matmul (thousands of lines per generate)
    warnings.filterwarnings("ignore", message=".*MatMul8bitLt.*")

    return AutoModelForCausalLM.from_pretrained(directory, device_map="cpu").eval()


def load_gguf(path: Path):
    """(model, tokenizer) of a GGUF file, dequantized to float32 by transformers (tens of seconds)."""
    from transformers import AutoModelForCausalLM

    with one_gguf_parse():
        tokenizer = load_tokenizer(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.hf_quantizer = None  # the GGUF weights are dequantized now; nothing is left to serialize
    return model.eval(), tokenizer


@contextlib.contextmanager
def one_gguf_parse():
    """Within the block, transformers reads each GGUF file's metadata once.

    transformers' `load_gguf_checkpoint` opens the file afresh (`gguf.GGUFReader`) and turns every metadata field
    into Python values for each of its callers: the config, the tokenizer (twice) and the weights. The reader builds
    a numpy view per element of the vocabulary's arrays, so one read costs seconds (SmolLM2's 49,152 tokens) to
    tens of seconds (Gemma 3's 262,144) in Python. Its map of tensor names is also built afresh for each of the
    model's modules (`gguf.get_tensor_name_map`: 397 times for SmolLM2, seconds). Here the metadata-only calls
    share one result (each caller gets its own deep copy: they edit what they get), every call one reader (read-only
    memory maps) and one name map per (architecture, layers). transformers looks these names up at call time (an
    import inside its functions), so they are swapped for the block and put back after it."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    open_reader, load_checkpoint, name_map = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map
    reader, tensor_name_map = functools.cache(open_reader), functools.cache(name_map)
    metadata = {}

    def checkpoint(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return load_checkpoint(path, return_tensors, *args, **kwargs)
        key = os.fspath(path)
        if key not in metadata:
            metadata[key] = load_checkpoint(path, False)
        return copy.deepcopy(metadata[key])

    gguf.GGUFReader, hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map = reader, checkpoint, tensor_name_map
    try:
        yield
    finally:
        gguf.GGUFReader, hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map = open_reader, load_checkpoint, name_map


def load_tokenizer(directory: Path, gguf_file: str | None = None):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file) if gguf_file \
            else AutoTokenizer.from_pretrained(directory)
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as e:
        raise SourceError(f"{directory}: tokenizer cannot be loaded ({str(e).splitlines()[0]})") from None


def count_parameters(model) -> int:
    """Parameters counted once each (a tied lm_head is not counted twice)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel()
    return total


def model_info(model) -> dict:
    """The manifest's facts about a model: architecture, parameters, dtype, layers, sizes."""
    cfg = model.config
    return {"architecture": (cfg.architectures or [type(model).__name__])[0], "model_type": cfg.model_type,
            "num_parameters": count_parameters(model), "dtype": DTYPE_NAMES.get(next(model.parameters()).dtype),
            "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size}
