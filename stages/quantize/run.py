"""The quantize stage end to end: load, quantize layer by layer, write, evaluate before/after."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..artifact import Artifact, ArtifactWriter, check_destination
from ..evaluate import EvalConfig, evaluate, metric_key
from ..importer import model_info
from ..model_io import load_model_dir, load_tokenizer, save_model
from ..source import Loaded, load, source_record
from .config import QuantizeConfig
from .stage import QuantizeHooks, check_not_quantized, export_state, per_layer_table, plan_targets, quantize_model


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
    start = time.perf_counter()
    method, reports = quantize_model(loaded.model, loaded.tokenizer, config, hooks)
    seconds = time.perf_counter() - start
    state, qconfig = export_state(loaded.model, method)
    hooks.status(f"writing {dest}")
    with ArtifactWriter(dest, force=force) as w:
        save_model(loaded.model, loaded.tokenizer, w.tmp, state=state, quantization_config=qconfig)
        info = model_info(loaded.model)
        art = w.commit("quantize", config.to_dict(), loaded.artifact, _source(loaded), model=info,
                       metrics={"size_bytes": _weights_bytes(w.tmp), "quantize_seconds": round(seconds, 1),
                                "quantization": per_layer_table(method, reports)})
    _evaluate_written(art, config, hooks, base)
    return art


def _name(dtype: torch.dtype) -> str:
    from ..model_io import DTYPE_NAMES

    return DTYPE_NAMES.get(dtype, str(dtype))


def _source(loaded: Loaded) -> dict:
    return loaded.artifact.manifest["source"] if loaded.artifact else source_record(loaded.source)


def _weights_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def _eval_config(config: QuantizeConfig) -> EvalConfig:
    return EvalConfig(text="wikitext2", seqlen=2048, max_windows=config.eval_windows)


def _eval(model, tokenizer, config, hooks, label: str, artifact: Artifact | None) -> dict | None:
    """Perplexity on the quick subset, reusing a result already stored in the artifact."""
    if config.eval_windows == 0:
        return None
    ecfg = _eval_config(config)
    key = metric_key(ecfg)
    if artifact is not None and key in artifact.manifest.get("metrics", {}):
        return artifact.manifest["metrics"][key]
    hooks.status(f"perplexity of the {label} model on {config.eval_windows} windows")
    result = evaluate(model, tokenizer, ecfg, on_window=hooks.window).to_dict()
    result.pop("window_nll")
    if artifact is not None:
        artifact.update_metrics(key, result)
    return result


def _evaluate_written(art: Artifact, config: QuantizeConfig, hooks, base: dict | None) -> None:
    """Evaluate the artifact as written (loaded back from disk), store before/after."""
    if base is None:
        return
    model = load_model_dir(art.path, files=art.weight_files)
    after = _eval(model, load_tokenizer(art.path), config, hooks, "quantized", art)
    art.update_metrics("perplexity_before_after", {
        "protocol": f"wikitext2 test, seqlen 2048, first {config.eval_windows} windows",
        "before": base["perplexity"], "after": after["perplexity"],
        "increase_pct": 100 * (after["perplexity"] / base["perplexity"] - 1)})
