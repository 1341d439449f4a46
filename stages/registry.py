"""Every stage a recipe can run: its kind, its config class (which holds its options and builds itself
from them) and its entry point. Recipes read their schema and builders here, and run the stages
through it, so they never restate a stage's options or its steps.

The config classes are light (no torch): they load with the registry. An entry point is imported
when it is first run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from .bench.stage import BenchStageConfig
from .errors import ConfigError
from .eval.config import EvalConfig
from .options import Options
from .profile.config import ProfileConfig
from .prune.config import PruneConfig
from .quantize.config import QuantizeConfig
from .shard.config import ShardConfig


@dataclass(frozen=True)
class Stage:
    """One kind of stage. `run` is its entry point:

    - writes_artifact (prune, quantize, shard): run(source_ref, dest, config, force=..., hooks=...) -> Artifact
    - eval: run(source_ref, config, hooks) -> {text: EvalResult}, each stored in the source's manifest
    - profile: run(source_refs, config, hooks) -> report
    - bench: run(config, requests, source_ref, hooks) -> BenchOutcome, one server per source
    """

    kind: str
    config: type
    writes_artifact: bool = False  # a new model artifact, which later stages can read
    multi_input: bool = False  # measures several models side by side

    @property
    def options(self) -> Options:
        """What a recipe stage of this kind takes (its config's options)."""
        return self.config.options()

    def build(self, options: Mapping[str, object]):
        """The stage's validated config for these options (ConfigError names what is wrong)."""
        return self.config.from_options(options)

    @property
    def run(self) -> Callable:
        """The stage's entry point (see the class docstring for each kind's call)."""
        return _entry_point(self.kind)


STAGES = {s.kind: s for s in (
    Stage("prune", PruneConfig, writes_artifact=True),
    Stage("quantize", QuantizeConfig, writes_artifact=True),
    Stage("shard", ShardConfig, writes_artifact=True),
    Stage("eval", EvalConfig, multi_input=True),
    Stage("profile", ProfileConfig, multi_input=True),
    Stage("bench", BenchStageConfig, multi_input=True),
)}
KINDS = tuple(STAGES)


def stage(kind: str) -> Stage:
    """The stage of this kind; ConfigError lists the kinds there are."""
    if kind not in STAGES:
        raise ConfigError(f"unknown stage {kind!r}; choose one of {', '.join(KINDS)}")
    return STAGES[kind]


def _entry_point(kind: str) -> Callable:
    # Imported on use: the entry points pull in torch, transformers or the HTTP client.
    if kind == "prune":
        from .prune.run import run_prune as run
    elif kind == "quantize":
        from .quantize.run import run_quantize as run
    elif kind == "shard":
        from .shard.run import run_shard as run
    elif kind == "eval":
        from .eval.run import run_evals as run
    elif kind == "profile":
        from .profile.run import run_profile as run
    else:
        from .bench.run import bench_source as run
    return run
