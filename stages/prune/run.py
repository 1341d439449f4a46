"""The prune stage end to end: load, prune, write a plain dense artifact, evaluate before/after."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..artifact import Artifact, ArtifactWriter, check_destination
from ..importer import model_info
from ..model_io import DTYPE_NAMES, save_model
from ..source import Loaded, load, source_record
from ..stage_eval import evaluate_written, perplexity
from .config import PruneConfig
from .stage import PruneHooks, check_plan, prune_model


def run_prune(source_ref: str, dest: Path, config: PruneConfig, dtype: torch.dtype | None = None,
              force: bool = False, hooks: PruneHooks | None = None) -> Artifact:
    """Prune `source_ref` into a new artifact at `dest`; returns it with metrics stored.

    Bad options and models they do not fit raise ConfigError before anything is computed or written.
    """
    hooks = hooks or PruneHooks()
    config.validate()
    check_destination(dest, force)
    hooks.status(f"loading {source_ref}")
    loaded = load(source_ref, dtype=dtype)
    check_plan(loaded.model, config)
    base = perplexity(loaded.model, loaded.tokenizer, config.eval_windows, hooks, "base", _cache(loaded, dtype))
    params_before = model_info(loaded.model)["num_parameters"]
    start = time.perf_counter()
    record = prune_model(loaded.model, loaded.tokenizer, config, hooks)
    seconds = time.perf_counter() - start
    hooks.status(f"writing {dest}")
    with ArtifactWriter(dest, force=force) as w:
        save_model(loaded.model, loaded.tokenizer, w.tmp)
        info = model_info(loaded.model)
        metrics = {"size_bytes": _weights_bytes(w.tmp), "prune_seconds": round(seconds, 1),
                   "num_parameters_before": params_before, "num_parameters": info["num_parameters"], **record}
        if config.needs_calibration:
            metrics["calibration"] = config.calib.describe()
        art = w.commit("prune", config.to_dict(), loaded.artifact, _source(loaded), model=info, metrics=metrics)
    evaluate_written(art, config.eval_windows, hooks, base, "pruned")
    return art


def _cache(loaded: Loaded, dtype: torch.dtype | None) -> Artifact | None:
    """The source artifact, where its stored perplexity is valid for the dtype we run in."""
    if loaded.artifact is None:
        return None
    same = dtype is None or loaded.artifact.manifest["model"].get("dtype") == DTYPE_NAMES.get(dtype, str(dtype))
    return loaded.artifact if same else None


def _source(loaded: Loaded) -> dict:
    return loaded.artifact.manifest["source"] if loaded.artifact else source_record(loaded.source)


def _weights_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))
