"""The prune stage end to end: load, prune, write a plain dense artifact, evaluate before/after."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from ..artifact import Artifact, ArtifactWriter, check_destination, safetensors_bytes
from ..calib import resolve_calib
from ..eval.before_after import perplexity, reusable_artifact, store_before_after
from ..model_io import model_info, parse_dtype, save_model
from ..profile.machine import HOST, peak_memory, reset_peak_memory
from ..safetensors_io import state_bytes
from ..source import load, source_record
from .config import PruneConfig
from .stage import PruneHooks, check_plan, prune_model


def run_prune(source_ref: str, dest: Path, config: PruneConfig, force: bool = False,
              hooks: PruneHooks | None = None) -> Artifact:
    """Prune `source_ref` into a new artifact at `dest`; returns it with metrics stored.

    Bad options and models they do not fit raise ConfigError before anything is computed or written.
    """
    hooks = hooks or PruneHooks()
    config.validate()
    check_destination(dest, force)
    reset_peak_memory(HOST)  # the run's peak resident set goes into its metrics
    hooks.status(f"loading {source_ref}")
    loaded = load(source_ref, dtype=parse_dtype(config.dtype))
    config = replace(config, calib=resolve_calib(config.calib, loaded.tokenizer))  # the manifest says what `auto` took
    check_plan(loaded.model, config)
    base = perplexity(loaded.model, loaded.tokenizer, config.eval_windows, hooks, "base",
                      reusable_artifact(loaded, config.dtype))
    params_before = model_info(loaded.model)["num_parameters"]
    start = time.perf_counter()
    record = prune_model(loaded.model, loaded.tokenizer, config, hooks)
    seconds = time.perf_counter() - start
    hooks.status(f"writing {dest}")
    with ArtifactWriter(dest, force=force) as w:
        w.check_space(state_bytes(loaded.model.state_dict()))
        save_model(loaded.model, loaded.tokenizer, w.tmp)
        info = model_info(loaded.model)
        metrics = {"size_bytes": safetensors_bytes(w.tmp), "prune_seconds": round(seconds, 1),
                   "peak_rss_bytes": peak_memory(HOST),
                   "num_parameters_before": params_before, "num_parameters": info["num_parameters"], **record}
        if config.needs_calibration:
            metrics["calibration"] = config.calib.describe()
        art = w.commit("prune", config.to_dict(), loaded.artifact, source_record(loaded.source, loaded.artifact),
                       model=info, metrics=metrics)
    store_before_after(art, config.eval_windows, hooks, base, "pruned")
    return art

