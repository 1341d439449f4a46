"""EvalConfig: what `llmopt eval` measures (text, window length, how many windows, KL reference, dtype)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..errors import ConfigError
from ..options import FromOptions, Option, Options, dtype_option


@dataclass(frozen=True)
class EvalConfig(FromOptions):
    """What `llmopt eval` measures; its options are its fields, under the same names."""

    text: str = "wikitext2"
    seqlen: int = 2048
    max_windows: int | None = None  # None: every window of the text
    ref: str | None = None  # a model source: mean KL(ref || model) per token besides the perplexity
    dtype: str = "auto"  # the dtype both models run in (auto keeps each checkpoint's)
    runtime: str = "transformers"  # what computes the logits: transformers, or llmopt's serve runtime ("serve")

    @classmethod
    def from_values(cls, values: dict) -> "EvalConfig":
        """The config for every option's value (the options are the fields)."""
        return cls(**values)

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> "EvalConfig":
        """The validated config for these options; a missing text fails here, before any model loads."""
        from ..data import resolve_text

        config = super().from_options(options)
        resolve_text(config.text)
        return config

    def validate(self) -> None:
        if self.seqlen < 2:
            raise ConfigError(f"--seqlen must be at least 2 (got {self.seqlen})")
        if self.max_windows is not None and self.max_windows < 1:
            raise ConfigError(f"--max-windows must be at least 1 (got {self.max_windows})")
        if self.runtime not in RUNTIMES:
            raise ConfigError(f"--runtime {self.runtime!r}: use one of {', '.join(RUNTIMES)}")
        if self.runtime == "serve" and self.ref:
            raise ConfigError("--ref (KL divergence) runs with --runtime transformers only")

    def metric_key(self) -> str:
        """The manifest key a result is stored under: one per protocol (text, seqlen, windows, reference)."""
        windows = self.max_windows or "all"
        ref = f"/kl-vs-{Path(self.ref).name}" if self.ref else ""
        runtime = "/serve-runtime" if self.runtime == "serve" else ""
        return f"eval/{Path(self.text).name}/seqlen{self.seqlen}/windows-{windows}{ref}{runtime}"


RUNTIMES = ("transformers", "serve")
DEFAULTS = EvalConfig()
OPTIONS = Options(
    Option("text", str, DEFAULTS.text), Option("seqlen", int, DEFAULTS.seqlen),
    Option("max_windows", int, DEFAULTS.max_windows, optional=True), Option("ref", str, DEFAULTS.ref, optional=True),
    dtype_option(DEFAULTS.dtype), Option("runtime", str, DEFAULTS.runtime),
)
EvalConfig.OPTIONS = OPTIONS
