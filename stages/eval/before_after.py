"""Perplexity before/after for the stages that rewrite a model (quantize, prune).

The protocol is fixed (WikiText-2 test, seqlen 2048, the first `windows` windows) so that numbers
from different stages compare; a result already stored in an artifact's manifest is reused.
"""
from __future__ import annotations

from .artifact import Artifact
from .evaluate import EvalConfig, evaluate, metric_key


def eval_config(windows: int) -> EvalConfig:
    return EvalConfig(text="wikitext2", seqlen=2048, max_windows=windows)


def perplexity(model, tokenizer, windows: int, hooks, label: str, artifact: Artifact | None) -> dict | None:
    """Perplexity on the quick subset (None when `windows` is 0), stored in / reused from `artifact`."""
    if windows == 0:
        return None
    ecfg = eval_config(windows)
    key = metric_key(ecfg)
    if artifact is not None and key in artifact.manifest.get("metrics", {}):
        return artifact.manifest["metrics"][key]
    hooks.status(f"perplexity of the {label} model on {windows} windows")
    result = evaluate(model, tokenizer, ecfg, on_window=hooks.window).to_dict()
    result.pop("window_nll")
    if artifact is not None:
        artifact.update_metrics(key, result)
    return result


def evaluate_written(art: Artifact, windows: int, hooks, base: dict | None, label: str) -> None:
    """Evaluate the artifact as written (loaded back from disk); store `perplexity_before_after`."""
    from .model_io import load_model_dir, load_tokenizer

    if base is None:
        return
    model = load_model_dir(art.path, files=art.weight_files)
    after = perplexity(model, load_tokenizer(art.path), windows, hooks, label, art)
    art.update_metrics("perplexity_before_after", {
        "protocol": f"wikitext2 test, seqlen 2048, first {windows} windows",
        "before": base["perplexity"], "after": after["perplexity"],
        "increase_pct": 100 * (after["perplexity"] / base["perplexity"] - 1)})
