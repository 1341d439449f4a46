"""ServeConfig: every option of `llmopt serve`, each default defined once.

The engine's options live in EngineConfig, the HTTP server's in ServerConfig; this adds where the
model runs (device, dtype) and where this process sits in a multi-node tensor-parallel group.
`ServeConfig.from_options` builds it from options named as the CLI's parameters, so the CLI,
recipes and library users share one set of defaults. Light on purpose: no torch, no FastAPI.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import ConfigError
from .engine.config import EngineConfig
from .http.config import ServerConfig

DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")  # auto keeps the source's
# CLI spellings of ServerConfig fields (the config names the unit, the option does not)
RENAMED = {"request_timeout": "request_timeout_s", "drain_timeout": "drain_timeout_s"}


@dataclass(frozen=True)
class ServeConfig:
    """`llmopt serve`'s configuration; validated on construction (each part validates itself)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: str = "auto"  # one of DTYPE_CHOICES
    nnodes: int = 1  # machines a sharded artifact's ranks span
    node_rank: int = 0  # this machine's index: 0 serves HTTP, the others only run their ranks
    master_addr: str = "127.0.0.1"  # node 0's address for the rank rendezvous
    master_port: int | None = None  # None: a free port (single node only)

    def __post_init__(self) -> None:
        # The group's own checks (rank in range, a port for several nodes) run when it starts.
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"unknown --dtype {self.dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> ServeConfig:
        """The config for options named as `llmopt serve`'s parameters (`max_num_seqs`,
        `request_timeout`, ...). A missing option, or one given as None, takes its default;
        an unknown name is a ConfigError naming it."""
        known = option_names()
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown serve option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        # an Enum (the CLI's --dtype choices) stands for its value
        given = {name: getattr(value, "value", value) for name, value in options.items() if value is not None}
        engine = {f: given[f] for f in _fields(EngineConfig) if f in given}
        server = {RENAMED.get(o, o): given[o] for o in _server_options() if o in given}
        own = {f: given[f] for f in _fields(cls) - {"engine", "server"} if f in given}
        return cls(engine=EngineConfig(**engine), server=ServerConfig(**server), **own)


def option_names() -> set[str]:
    """Every option `ServeConfig.from_options` knows, spelled as the CLI's parameters."""
    return _fields(EngineConfig) | _server_options() | (_fields(ServeConfig) - {"engine", "server"})


def _server_options() -> set[str]:
    by_field = {v: k for k, v in RENAMED.items()}
    return {by_field.get(f, f) for f in _fields(ServerConfig)}


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


DEFAULTS = ServeConfig()  # what every option is when not given: the CLI reads its defaults here
