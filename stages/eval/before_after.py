"""Perplexity before/after for the stages that rewrite a model (quantize, prune).

The protocol is fixed (WikiText-2 test, seqlen 2048, the first `windows` windows) so that numbers
from different stages compare; a result already stored in an artifact's manifest is reused.
"""
from __future__ import annotations

from ..artifact import Artifact
from .config import EvalConfig
from .perplexity import evaluate

TEXT, SEQLEN = "wikitext2", 2048  # the protocol; not EvalConfig's defaults, which may change


def quick_config(windows: int) -> EvalConfig:
    """The before/after protocol on its first `windows` windows."""
    return EvalConfig(text=TEXT, seqlen=SEQLEN, max_windows=windows)


def reusable_artifact(loaded, dtype: str) -> Artifact | None:
    """The loaded source's artifact when the perplexity it stores holds for the `dtype` we run in
    (auto, or the dtype it was written in); else None."""
    art = loaded.artifact
    if art is None or dtype in ("auto", art.manifest.get("model", {}).get("dtype")):
        return art
    return None


def perplexity(model, tokenizer, windows: int, hooks, label: str, artifact: Artifact | None) -> dict | None:
    """Perplexity on the quick subset (None when `windows` is 0), stored in / reused from `artifact`."""
    if windows == 0:
        return None
    config = quick_config(windows)
    key = config.metric_key()
    if artifact is not None and key in artifact.manifest.get("metrics", {}):
        return artifact.manifest["metrics"][key]
    hooks.status(f"perplexity of the {label} model on {windows} windows")
    result = evaluate(model, tokenizer, config, on_window=hooks.window).record()
    if artifact is not None:
        artifact.update_metrics(key, result)
    return result


def store_before_after(art: Artifact, windows: int, hooks, base: dict | None, label: str) -> None:
    """Evaluate the artifact as written (loaded back from disk); store `perplexity_before_after`."""
    from ..model_io import load_model_dir, load_tokenizer

    if base is None:
        return
    model = load_model_dir(art.path, files=art.weight_files)
    after = perplexity(model, load_tokenizer(art.path), windows, hooks, label, art)
    art.update_metrics("perplexity_before_after", {
        "protocol": f"{TEXT} test, seqlen {SEQLEN}, first {windows} windows",
        "before": base["perplexity"], "after": after["perplexity"],
        "increase_pct": 100 * (after["perplexity"] / base["perplexity"] - 1)})
