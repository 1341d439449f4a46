"""`llmopt import`: any source -> a base artifact (stage `import`)."""
from __future__ import annotations

from pathlib import Path

import torch

from .artifact import Artifact, ArtifactWriter
from .model_io import DTYPE_NAMES, count_parameters, save_model


def _load_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    from .model_io import load_tokenizer

    tokenizer = load_tokenizer(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.hf_quantizer = None  # the GGUF weights are dequantized now; nothing is left to serialize
    return model.eval(), tokenizer


def load_raw(source):
    """Load a non-artifact source with plain transformers machinery."""
    from .model_io import load_model_dir, load_tokenizer

    if source.kind in ("alias", "gguf"):
        return _load_gguf(source.path)
    return load_model_dir(source.path), load_tokenizer(source.path)


def import_source(source, dest: Path, dtype: torch.dtype | None = None, force: bool = False,
                  max_shard_bytes: int = 2 << 30, progress=None, use_cache: bool = True) -> Artifact:
    """Write `source` as an import artifact at `dest`, converting to `dtype` when given.

    GGUF sources are read through the import cache when `use_cache` (the cache itself is written
    with use_cache=False).
    """
    from .source import as_artifact, source_record

    if progress:
        progress(f"loading {source.ref}")
    parent = None
    if source.kind == "artifact":
        parent = Artifact.open(source.path)
        from .model_io import load_model_dir, load_tokenizer

        model, tokenizer = load_model_dir(source.path), load_tokenizer(source.path)
    elif source.kind in ("alias", "gguf") and use_cache:
        cached = as_artifact(source, progress)
        from .model_io import load_model_dir, load_tokenizer

        model, tokenizer = load_model_dir(cached.path, files=cached.weight_files), load_tokenizer(cached.path)
    else:
        model, tokenizer = load_raw(source)
    if dtype is not None:
        model = model.to(dtype)
    stored = next(model.parameters()).dtype
    config = {"source": source.ref, "dtype": DTYPE_NAMES.get(stored, str(stored)), "max_shard_bytes": max_shard_bytes}
    if progress:
        progress(f"writing {dest}")
    with ArtifactWriter(dest, force=force) as w:
        save_model(model, tokenizer, w.tmp, max_shard_bytes)
        info = model_info(model)
        return w.commit("import", config, parent, source_record(source), model=info,
                        metrics={"size_bytes": _weights_bytes(w.tmp), "num_parameters": info["num_parameters"]})


def model_info(model) -> dict:
    cfg = model.config
    return {"architecture": (cfg.architectures or [type(model).__name__])[0], "model_type": cfg.model_type,
            "num_parameters": count_parameters(model), "dtype": DTYPE_NAMES.get(next(model.parameters()).dtype),
            "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size}


def _weights_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))
