"""Perplexity before/after for the stages that rewrite a model (quantize, prune).

The protocol is fixed (seqlen 2048, the first `windows` windows of each evaluation set of texts.EVAL_SETS that the
model takes: chat only with a chat template) so that numbers from different stages compare; a result already
stored in an artifact's manifest is reused. `perplexity_before_after` keeps WikiText-2's numbers at its top level,
as manifests always had them, and every set's under `sets`.
"""
from __future__ import annotations

from ..artifact import Artifact
from .config import EvalConfig
from .measure import evaluate, unavailable_sets
from .texts import EVAL_SETS

TEXT, SEQLEN = "wikitext2", 2048  # the protocol; not EvalConfig's defaults, which may change


def quick_config(windows: int, text: str = TEXT) -> EvalConfig:
    """The before/after protocol on the first `windows` windows of `text`."""
    return EvalConfig(text=text, seqlen=SEQLEN, max_windows=windows)


def reusable_artifact(loaded, dtype: str) -> Artifact | None:
    """The loaded source's artifact when the perplexity it stores holds for the `dtype` we run in
    (auto, or the dtype it was written in); else None."""
    art = loaded.artifact
    if art is None or dtype in ("auto", art.manifest.get("model", {}).get("dtype")):
        return art
    return None


def perplexity(model, tokenizer, windows: int, hooks, label: str, artifact: Artifact | None,
               sets: list[str] | None = None) -> dict[str, dict] | None:
    """{set: result record} on the quick subset of each of `sets` (default: every set the model takes), each
    stored in / reused from `artifact`; None when `windows` is 0."""
    if windows == 0:
        return None
    if sets is None:
        skipped = unavailable_sets(tokenizer)
        sets = [name for name in EVAL_SETS if name not in skipped]
        for name, why in skipped.items():
            hooks.status(f"perplexity of the {label} model: {name} skipped ({why})")
    stored = artifact.manifest.get("metrics", {}) if artifact is not None else {}
    results = {}
    for name in sets:
        config = quick_config(windows, name)
        key = config.metric_key()
        if key in stored:
            results[name] = stored[key]
            continue
        hooks.status(f"perplexity of the {label} model on {windows} windows of {name}")
        results[name] = evaluate(model, tokenizer, config, on_window=hooks.window).record()
        if artifact is not None:
            artifact.update_metrics(key, results[name])
    return results


def store_before_after(art: Artifact, windows: int, hooks, base: dict | None, label: str) -> None:
    """Evaluate the artifact as written (loaded back from disk) on the sets `base` holds; store
    `perplexity_before_after`."""
    from ..model_io import load_model_dir, load_tokenizer

    if base is None:
        return
    model = load_model_dir(art.path, files=art.weight_files)
    tokenizer = load_tokenizer(art.path)
    after = perplexity(model, tokenizer, windows, hooks, label, art, sets=list(base))
    art.update_metrics("perplexity_before_after", before_after(windows, base, after, unavailable_sets(tokenizer)))


def before_after(windows: int, base: dict[str, dict], after: dict[str, dict], skipped: dict[str, str]) -> dict:
    """The record: WikiText-2's before, after and increase at the top level (as older manifests have them; `text`
    names it), each set's under `sets` (with the metric key of its full results), the sets left out under
    `skipped` (with why)."""
    sets = {name: {"before": base[name]["perplexity"], "after": after[name]["perplexity"],
                   "increase_pct": 100 * (after[name]["perplexity"] / base[name]["perplexity"] - 1),
                   "metric": quick_config(windows, name).metric_key()} for name in base}
    main = {k: v for k, v in sets[TEXT].items() if k != "metric"}
    return {"protocol": f"{TEXT} test, seqlen {SEQLEN}, first {windows} windows", "text": TEXT, **main,
            "sets": sets, "sets_protocol": f"seqlen {SEQLEN}, first {windows} windows of each set",
            "skipped": skipped}
