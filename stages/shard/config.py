"""The shard stage's config: how many tensor-parallel ranks (no default: the user says)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..options import FromOptions, Option, Options


@dataclass(frozen=True)
class ShardConfig(FromOptions):
    """How many tensor-parallel ranks to split a model for."""

    tp: int

    @classmethod
    def from_values(cls, values: dict) -> "ShardConfig":
        """The config for the --tp value."""
        return cls(tp=values["tp"])

    def validate(self) -> None:
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ConfigError(f"--tp must be a positive integer (got {self.tp!r})")

    def to_dict(self) -> dict:
        return {"tp": self.tp}


OPTIONS = Options(Option("tp", int))  # required: no default
ShardConfig.OPTIONS = OPTIONS
