"""The shard stage's config."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class ShardConfig:
    tp: int

    def validate(self) -> None:
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ConfigError(f"--tp must be a positive integer (got {self.tp!r})")

    def to_dict(self) -> dict:
        return {"tp": self.tp}
