"""`run_evals`: the eval stage's one entry point, for `llmopt eval` and a recipe's eval stage (`run_eval`: the
same for a config of one text)."""
from __future__ import annotations

from ..errors import DataError
from ..model_io import parse_dtype
from ..progress import StageHooks
from ..source import load
from .config import EvalConfig
from .measure import evaluate, unavailable_sets
from .perplexity import EvalResult


def load_reference(config: EvalConfig, hooks: StageHooks | None = None):
    """The --ref model (None without one), to load once for any number of sources."""
    if config.ref is None:
        return None
    (hooks or StageHooks()).status(f"loading {config.ref}")
    return load(config.ref, dtype=parse_dtype(config.dtype)).model


def run_evals(source: str, config: EvalConfig, hooks: StageHooks | None = None, store: bool = True,
              reference=None) -> dict[str, EvalResult]:
    """Load `source` once and measure it on each of the config's texts, in order ({text: result}); when it is an
    artifact and `store`, keep each result in its manifest under that text's metric key. `reference`: the --ref
    model when already loaded (see `load_reference`)."""
    hooks = hooks or StageHooks()
    config.validate()
    hooks.status(f"loading {source}")
    model, tokenizer, artifact = _load(source, config)
    cannot = unavailable_sets(tokenizer)
    for name in config.texts():  # before any set is measured
        if name in cannot:
            raise DataError(f"--text {name}: {cannot[name]} ({source}); leave {name} out")
    if reference is None:
        reference = load_reference(config, hooks)
    results = {}
    for one in config.split():
        if len(config.texts()) > 1:
            hooks.status(f"measuring {one.text}")
        results[one.text] = evaluate(model, tokenizer, one, ref_model=reference, on_window=hooks.window)
        if store and artifact is not None:
            artifact.update_metrics(one.metric_key(), results[one.text].record())
    return results


def run_eval(source: str, config: EvalConfig, hooks: StageHooks | None = None, store: bool = True,
             reference=None) -> EvalResult:
    """`run_evals` for a config of one text: its result."""
    text = config.single_text()
    return run_evals(source, config, hooks, store, reference)[text]


def _load(source: str, config: EvalConfig):
    """(model, tokenizer, artifact or None): transformers' model, or the serve runtime's (serve_runtime.py)
    computing the logits under the same protocol."""
    if config.runtime != "serve":
        loaded = load(source, dtype=parse_dtype(config.dtype))
        return loaded.model, loaded.tokenizer, loaded.artifact
    from ..source import as_artifact, resolve
    from .serve_runtime import ServeRuntimeModel

    model = ServeRuntimeModel(source, parse_dtype(config.dtype), config.seqlen)
    return model, model.tokenizer, as_artifact(resolve(source))
