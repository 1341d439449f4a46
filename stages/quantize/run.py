"""The quantize stage end to end: load, quantize layer by layer, write, evaluate before/after."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..artifact import Artifact, ArtifactWriter, check_destination
from ..importer import model_info
from ..model_io import save_model_files
from ..safetensors_io import ShardWriter
from ..source import Loaded, load, source_record
from ..stage_eval import evaluate_written, perplexity
from .config import QuantizeConfig
from .embeddings import quantize_embedding
from .stage import (QuantizeHooks, check_not_quantized, per_layer_table, plan_targets, quantization_config_of,
                    quantize_model, rest_of_state)


def run_quantize(source_ref: str, dest: Path, config: QuantizeConfig, dtype: torch.dtype | None = None,
                 force: bool = False, hooks: QuantizeHooks | None = None) -> Artifact:
    """Quantize `source_ref` into a new artifact at `dest`; returns it with metrics stored."""
    hooks = hooks or QuantizeHooks()
    config.validate()
    check_destination(dest, force)
    hooks.status(f"loading {source_ref}")
    loaded = load(source_ref, dtype=dtype)
    check_not_quantized(loaded.model)
    if config.method == "bnb":
        from .bnb import run_bnb

        return run_bnb(loaded, dest, config, force, hooks)
    plan_targets(loaded.model, config)  # bad group sizes / ignore patterns fail before any work
    same_dtype = dtype is None or (loaded.artifact and loaded.artifact.manifest["model"].get("dtype") == _name(dtype))
    base = _eval(loaded.model, loaded.tokenizer, config, hooks, "base", loaded.artifact if same_dtype else None)
    info = model_info(loaded.model)
    with ArtifactWriter(dest, force=force) as w:  # layers stream into it; any failure removes it
        shards = ShardWriter(w.tmp)
        start = time.perf_counter()
        method, reports = quantize_model(loaded.model, loaded.tokenizer, config, hooks, sink=shards.add)
        embedding = quantize_embedding(loaded.model, config.embeddings)  # None: kept as is
        seconds = time.perf_counter() - start
        hooks.status(f"writing {dest}")
        shards.add(rest_of_state(loaded.model, method, embedding))
        shards.close()
        save_model_files(loaded.model, loaded.tokenizer, w.tmp, quantization_config_of(loaded.model, method, embedding))
        art = w.commit("quantize", config.to_dict(), loaded.artifact, _source(loaded), model=info,
                       metrics={"size_bytes": _weights_bytes(w.tmp), "quantize_seconds": round(seconds, 1),
                                "quantization": per_layer_table(method, reports, embedding)})
    _evaluate_written(art, config, hooks, base)
    return art


def _name(dtype: torch.dtype) -> str:
    from ..model_io import DTYPE_NAMES

    return DTYPE_NAMES.get(dtype, str(dtype))


def _source(loaded: Loaded) -> dict:
    return loaded.artifact.manifest["source"] if loaded.artifact else source_record(loaded.source)


def _weights_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def _eval(model, tokenizer, config, hooks, label: str, artifact: Artifact | None) -> dict | None:
    """Perplexity on the quick subset, reusing a result already stored in the artifact."""
    return perplexity(model, tokenizer, config.eval_windows, hooks, label, artifact)


def _evaluate_written(art: Artifact, config: QuantizeConfig, hooks, base: dict | None) -> None:
    """Evaluate the artifact as written (loaded back from disk), store before/after."""
    evaluate_written(art, config.eval_windows, hooks, base, "quantized")
