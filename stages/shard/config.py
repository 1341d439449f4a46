"""The shard stage's config: how many tensor-parallel ranks (no default: the user says)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..errors import ConfigError
from ..options import Option, Options


@dataclass(frozen=True)
class ShardConfig:
    tp: int

    @classmethod
    def options(cls) -> Options:
        """The options `llmopt shard` and a recipe's shard stage take."""
        return OPTIONS

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> "ShardConfig":
        """The validated config for these options (--tp is required)."""
        config = cls(tp=OPTIONS.complete(options)["tp"])
        config.validate()
        return config

    def validate(self) -> None:
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ConfigError(f"--tp must be a positive integer (got {self.tp!r})")

    def to_dict(self) -> dict:
        return {"tp": self.tp}


OPTIONS = Options(Option("tp", int))
