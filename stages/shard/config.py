"""The shard stage's config: tensor-parallel ranks per stage, pipeline stages, and optionally each stage's layers."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..options import FromOptions, Option, Options
from .pipeline import BALANCES, layer_ranges


@dataclass(frozen=True)
class ShardConfig(FromOptions):
    """How to split a model: `tp` tensor-parallel ranks in each of `pp` pipeline stages (tp 1, pp 1: one rank).

    `pp_layers` is the raw `--pp-layers` text ("0-9,10-19,20-29", inclusive ranges); None balances by bytes,
    those a decode step reads (`pp_balance` "decode") or those each stage stores ("memory")."""

    tp: int = 1
    pp: int = 1
    pp_layers: str | None = None
    pp_balance: str = "decode"

    @classmethod
    def from_values(cls, values: dict) -> "ShardConfig":
        """The config for the --tp, --pp, --pp-layers and --pp-balance values."""
        return cls(tp=values["tp"], pp=values["pp"], pp_layers=values["pp_layers"],
                   pp_balance=values.get("pp_balance", "decode"))

    def validate(self) -> None:
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--{name} must be a positive integer (got {value!r})")
        if self.pp_balance not in BALANCES:
            raise ConfigError(f"--pp-balance {self.pp_balance!r}: use one of {', '.join(BALANCES)}")
        if self.pp_layers is not None:  # the syntax here; the layer count comes with the model (run_shard)
            stages = len(layer_ranges(self.pp_layers))
            if stages != self.pp:
                raise ConfigError(f"--pp-layers {self.pp_layers} lists {stages} stages but --pp is {self.pp}; "
                                  f"pass --pp {stages}")

    def to_dict(self) -> dict:
        if self.pp == 1 and self.pp_layers is None:  # as before pipeline parallelism: old recipes' hashes hold
            return {"tp": self.tp}
        if self.pp_layers is not None:  # the stages are given: nothing was balanced
            return {"tp": self.tp, "pp": self.pp, "pp_layers": self.pp_layers}
        return {"tp": self.tp, "pp": self.pp, "pp_layers": None, "pp_balance": self.pp_balance}


DEFAULTS = ShardConfig()
OPTIONS = Options(Option("tp", int, DEFAULTS.tp), Option("pp", int, DEFAULTS.pp),
                  Option("pp_layers", str, DEFAULTS.pp_layers, optional=True),
                  Option("pp_balance", str, DEFAULTS.pp_balance, choices=BALANCES))
ShardConfig.OPTIONS = OPTIONS
