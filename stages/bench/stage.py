"""The bench stage as `llmopt bench` and a recipe's bench stage give it: its options and BenchStageConfig,
which holds the load (BenchConfig), the prompts (DatasetConfig), the --fail-on bounds and the server to
start on each source. Light to import: the command line reads the defaults here; run.py runs it.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace

from ..errors import ConfigError
from ..options import FromOptions, Option, Options
from .config import GRPC_AUTO, BenchConfig, normalize_grpc_target, normalize_url, parse_rate, parse_slo
from .dataset import DatasetConfig
from .server import ServerSpec


@dataclass(frozen=True)
class BenchStageConfig(FromOptions):
    """One bench stage: the load (its URL set per server), the prompts, the --fail-on bounds, and the
    server to start on each source (its source set per run)."""

    load: BenchConfig = field(default_factory=BenchConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    fail_on: tuple = ()  # gate.Bound, each a failure condition on the report
    server: ServerSpec = field(default_factory=lambda: ServerSpec(source=""))

    @classmethod
    def from_values(cls, o: dict) -> "BenchStageConfig":
        """The config for every option's value: `llmopt bench`'s options but the server's address, model
        and key, and the output files."""
        from .gate import parse_fail_on  # here: the gate reads the metrics, which pull in the HTTP client

        bounds = tuple(parse_fail_on(o["fail_on"]))
        load = BenchConfig(endpoint=o["endpoint"], request_rate=parse_rate(o["request_rate"]),
                           burstiness=o["burstiness"], max_concurrency=o["max_concurrency"], warmup=o["warmup"],
                           seed=o["seed"], temperature=o["temperature"], ignore_eos=o["ignore_eos"],
                           timeout_s=o["timeout"], slo=parse_slo(o["slo"]))
        data = DatasetConfig(o["dataset"], o["num_prompts"], o["input_len"], o["output_len"], o["seed"], o["tokenizer"],
                             shuffle=not o["disable_shuffle"])
        server = ServerSpec("", o["engine"], tuple(a for s in o["serve_args"] or () for a in shlex.split(s)),
                            startup_timeout_s=o["server_timeout"])
        return cls(load, data, bounds, server)

    def validate(self) -> None:
        """Each part's own checks (ConfigError names the option)."""
        self.load.validate()
        self.dataset.validate()
        self.server.validate()

    def aimed_at(self, url: str | None, model: str | None = None, api_key: str | None = None,
                 grpc: str | None = None) -> "BenchStageConfig":
        """This config against a running server (`url`, or `grpc` HOST:PORT for gRPC; normalized), or, with
        `grpc` "auto", over gRPC to the server it starts; with the model and key to send."""
        load = replace(self.load, url=normalize_url(url) if url else None,
                       grpc=normalize_grpc_target(grpc) if grpc else None, model=model, api_key=api_key)
        return replace(self, load=load)


def check_target(url: str | None, grpc: str | None, server: str | None) -> None:
    """One server per run: --url or --grpc HOST:PORT names a running one, --server SOURCE starts one (benched
    over gRPC with --grpc auto). A ConfigError says what to give instead."""
    if grpc is not None and normalize_grpc_target(grpc) == GRPC_AUTO:
        if server is None:
            raise ConfigError("--grpc auto benches the server that --server SOURCE starts over its gRPC port: give "
                              "--server SOURCE too, or --grpc HOST:PORT of a running server")
    elif grpc is not None:
        if server is not None:
            raise ConfigError("--grpc HOST:PORT names a running server; to bench the one --server starts over "
                              "gRPC, give --grpc auto")
        if url is not None:
            raise ConfigError("give --url or --grpc HOST:PORT, not both: each names a running server")
        return
    if (url is None) == (server is None):
        raise ConfigError("give --url URL of a running server, or --server SOURCE to start one (or --grpc "
                          "HOST:PORT of a running server's gRPC API; --offline SOURCE: the engine in this process)")


DEFAULTS = BenchStageConfig()
OPTIONS = Options(
    Option("engine", str, DEFAULTS.server.engine), Option("serve_args", list, None, optional=True),
    Option("server_timeout", float, DEFAULTS.server.startup_timeout_s),
    Option("endpoint", str, DEFAULTS.load.endpoint), Option("dataset", str, DEFAULTS.dataset.spec),
    Option("num_prompts", int, DEFAULTS.dataset.num_prompts), Option("input_len", int, DEFAULTS.dataset.input_len),
    Option("output_len", int, DEFAULTS.dataset.output_len, optional=True),
    Option("tokenizer", str, DEFAULTS.dataset.tokenizer, optional=True),
    Option("disable_shuffle", bool, not DEFAULTS.dataset.shuffle),
    Option("request_rate", str, str(DEFAULTS.load.describe()["request_rate"])),
    Option("burstiness", float, DEFAULTS.load.burstiness),
    Option("max_concurrency", int, DEFAULTS.load.max_concurrency, optional=True),
    Option("warmup", int, DEFAULTS.load.warmup), Option("seed", int, DEFAULTS.load.seed),
    Option("temperature", float, DEFAULTS.load.temperature), Option("ignore_eos", bool, DEFAULTS.load.ignore_eos),
    Option("timeout", float, DEFAULTS.load.timeout_s),
    Option("slo", str, None, optional=True),  # none: the config's empty {}
    Option("fail_on", str, None, optional=True),  # none: the config's ()
)
BenchStageConfig.OPTIONS = OPTIONS
