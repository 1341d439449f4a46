"""EvalConfig: what `llmopt eval` measures (texts, window length, how many windows, KL reference, dtype)."""
from __future__ import annotations

import platform
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

from ..errors import ConfigError, DataError
from ..options import FromOptions, Option, Options, dtype_option
from .texts import CHAT, CODE, EVAL_SETS, SHAREGPT, is_builtin_set

ALL = "all"  # --text all: every built-in evaluation set (EVAL_SETS)


@dataclass(frozen=True)
class EvalConfig(FromOptions):
    """What `llmopt eval` measures; its options are its fields, under the same names. `text` is one text or a
    comma list of them (`wikitext2,code,chat`, or `all`), each measured alike: `split` gives one config per text."""

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
        config = super().from_options(options)
        for name in config.texts():
            check_text(name)
        return config

    def validate(self) -> None:
        names = self.texts()
        if not all(names) or len(set(names)) < len(names):
            raise ConfigError(f"--text {self.text!r}: give each text once, separated by commas (e.g. wikitext2,code)")
        if ALL in names and len(names) > 1:
            raise ConfigError(f"--text {self.text!r}: `all` already names every set ({', '.join(EVAL_SETS)})")
        if self.seqlen < 2:
            raise ConfigError(f"--seqlen must be at least 2 (got {self.seqlen})")
        if self.max_windows is not None and self.max_windows < 1:
            raise ConfigError(f"--max-windows must be at least 1 (got {self.max_windows})")
        if self.runtime not in RUNTIMES:
            raise ConfigError(f"--runtime {self.runtime!r}: use one of {', '.join(RUNTIMES)}")
        if self.runtime == "serve" and self.ref:
            raise ConfigError("--ref (KL divergence) runs with --runtime transformers only")

    def texts(self) -> tuple[str, ...]:
        """The texts to measure, in the order given: `text` split at its commas (a file whose name holds a comma
        is one text); `all` is every built-in set."""
        if self.text == ALL:
            return EVAL_SETS
        if "," not in self.text or Path(self.text).expanduser().is_file():
            return (self.text,)
        return tuple(part.strip() for part in self.text.split(","))

    def split(self) -> list["EvalConfig"]:
        """One config per text, the rest alike."""
        return [replace(self, text=name) for name in self.texts()]

    def single_text(self) -> str:
        """The text of a config of one text (ValueError for a list: `split` gives one config per text)."""
        names = self.texts()
        if len(names) != 1:
            raise ValueError(f"--text {self.text} names {len(names)} texts: measure each config of split()")
        return names[0]

    def metric_key(self) -> str:
        """The manifest key a result is stored under: one per protocol (text, seqlen, windows, reference), for a
        config of one text. The code set's key names the Python version whose standard library it reads: another
        version's is another text, and a stored result is reused by its key (before_after.py)."""
        text = self.single_text()
        name = Path(text).name + (f"-py{platform.python_version()}" if text == CODE else "")
        windows = self.max_windows or "all"
        ref = f"/kl-vs-{Path(self.ref).name}" if self.ref else ""
        runtime = "/serve-runtime" if self.runtime == "serve" else ""
        return f"eval/{name}/seqlen{self.seqlen}/windows-{windows}{ref}{runtime}"


def check_text(name: str) -> None:
    """Fail on a text that cannot be found (DataError), so a run fails before it loads a model."""
    from ..data import BUILTIN_TEXTS, resolve_file, resolve_text

    if name == CHAT:
        resolve_file(SHAREGPT)
    elif not is_builtin_set(name):
        if name not in BUILTIN_TEXTS and not Path(name).expanduser().is_file():
            known = ", ".join([*BUILTIN_TEXTS, CODE, CHAT, ALL])
            raise DataError(f"--text {name}: no such text file and not a built-in name ({known})")
        resolve_text(name)


RUNTIMES = ("transformers", "serve")
DEFAULTS = EvalConfig()
OPTIONS = Options(
    Option("text", str, DEFAULTS.text), Option("seqlen", int, DEFAULTS.seqlen),
    Option("max_windows", int, DEFAULTS.max_windows, optional=True), Option("ref", str, DEFAULTS.ref, optional=True),
    dtype_option(DEFAULTS.dtype), Option("runtime", str, DEFAULTS.runtime),
)
EvalConfig.OPTIONS = OPTIONS
