"""`run_eval`: the eval stage's one entry point, for `llmopt eval` and a recipe's eval stage."""
from __future__ import annotations

from ..model_io import parse_dtype
from ..progress import StageHooks
from ..source import load
from .config import EvalConfig
from .perplexity import EvalResult, evaluate


def load_reference(config: EvalConfig, hooks: StageHooks | None = None):
    """The --ref model (None without one), to load once for any number of sources."""
    if config.ref is None:
        return None
    (hooks or StageHooks()).status(f"loading {config.ref}")
    return load(config.ref, dtype=parse_dtype(config.dtype)).model


def run_eval(source: str, config: EvalConfig, hooks: StageHooks | None = None, store: bool = True,
             reference=None) -> EvalResult:
    """Load `source`, measure it under `config` and, when it is an artifact and `store`, keep the result
    in its manifest. `reference`: the --ref model when already loaded (see `load_reference`)."""
    hooks = hooks or StageHooks()
    config.validate()
    hooks.status(f"loading {source}")
    if config.runtime == "serve":
        return _serve_runtime_eval(source, config, hooks, store)
    loaded = load(source, dtype=parse_dtype(config.dtype))
    if reference is None:
        reference = load_reference(config, hooks)
    result = evaluate(loaded.model, loaded.tokenizer, config, ref_model=reference, on_window=hooks.window)
    if store and loaded.artifact is not None:
        loaded.artifact.update_metrics(config.metric_key(), result.record())
    return result


def _serve_runtime_eval(source: str, config: EvalConfig, hooks: StageHooks, store: bool) -> EvalResult:
    """The same protocol with the serve runtime computing the logits (serve_runtime.py)."""
    from ..source import as_artifact, resolve
    from .serve_runtime import ServeRuntimeModel

    model = ServeRuntimeModel(source, parse_dtype(config.dtype), config.seqlen)
    result = evaluate(model, model.tokenizer, config, on_window=hooks.window)
    artifact = as_artifact(resolve(source))
    if store and artifact is not None:
        artifact.update_metrics(config.metric_key(), result.record())
    return result
