"""`llmopt import`: any source -> a base artifact (stage `import`), in the source's dtype or another."""
from __future__ import annotations

from pathlib import Path

import torch

from .artifact import SHARD_BYTES, Artifact
from .model_io import load_model_dir, load_tokenizer
from .source import Source, as_artifact, write_import


def import_source(source: Source, dest: Path, dtype: torch.dtype | None = None, force: bool = False,
                  max_shard_bytes: int = SHARD_BYTES, progress=None) -> Artifact:
    """Write `source` as an import artifact at `dest`, converting to `dtype` when given. A GGUF is read
    through the import cache; an artifact source becomes the new artifact's parent."""
    if progress:
        progress(f"loading {source.ref}")
    parent = Artifact.open(source.path) if source.kind == "artifact" else None
    model, tokenizer = _load(source, progress)
    if dtype is not None:
        model = model.to(dtype)
    return write_import(model, tokenizer, dest, source, parent, force, max_shard_bytes, progress)


def _load(source: Source, progress):
    if source.kind in ("alias", "gguf"):
        cached = as_artifact(source, progress)
        return load_model_dir(cached.path, files=cached.weight_files), load_tokenizer(cached.path)
    return load_model_dir(source.path), load_tokenizer(source.path)
