"""ServeConfig: every option of `llmopt serve`, each default defined once.

The engine's options live in EngineConfig, the HTTP server's in ServerConfig, a multi-node group's in
TPOptions; this adds where the model runs (device, dtype) and on which kernels (backend, one of
`llmopt.kernels.BACKENDS`). `ServeConfig.from_options` builds it from options named as the command's
parameters (the shared machinery of `stages/options.py`), so the command line and library users share
one set of defaults. Light on purpose: no torch, no FastAPI.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from llmopt.kernels import BACKENDS
from llmopt.kernels.threads import check_threads

from ..errors import ConfigError
from ..options import DTYPES, FromOptions, Option, Options, dtype_option
from .engine.config import EngineConfig, speculative_config
from .http.config import ServerConfig
from ..route.config import POLICIES
from .http.tenants import read_tenants


@dataclass(frozen=True)
class TPOptions:
    """Where this process sits in a multi-node tensor-parallel group (a single node needs none of it)."""

    nnodes: int = 1  # machines a sharded artifact's ranks span
    node_rank: int = 0  # this machine's index: 0 serves HTTP, the others only run their ranks
    master_addr: str = "127.0.0.1"  # node 0's address for the rank rendezvous
    master_port: int | None = None  # None: a free port (single node only)

    def validate(self, tp: int) -> None:
        """Checked against the artifact's rank count when the group starts."""
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} must be in [0, --nnodes {self.nnodes})")
        if tp % self.nnodes:
            raise ConfigError(f"the artifact has tp={tp} ranks, which --nnodes {self.nnodes} does not divide")
        if self.nnodes > 1 and self.master_port is None:
            raise ConfigError("--nnodes > 1 needs --master-addr and --master-port (node 0's address)")


@dataclass(frozen=True)
class ServeConfig(FromOptions):
    """`llmopt serve`'s configuration; validated on construction (each part validates itself)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: str = "auto"  # one of DTYPES: auto keeps the source's
    backend: str = "auto"  # the kernels: one of llmopt.kernels.BACKENDS
    tp: TPOptions = field(default_factory=TPOptions)
    threads: int | None = None  # CPU threads; None: the CPUs this process may use (llmopt.kernels.threads)
    tensor_parallel_size: int = 1  # vLLM's -tp: ranks to split an unsharded source over at load time
    data_parallel: int = 1  # engine replicas, each its own process and KV cache, behind one endpoint (data_parallel.py)
    cores_per_replica: int | None = None  # CPU: cores pinned to each replica; None: the CPUs shared out evenly
    router_policy: str = "cache-aware"  # how --data-parallel spreads requests (llmopt route's --policy)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown --dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown --backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size {self.tensor_parallel_size!r}: give a whole number >= 1")
        try:
            check_threads(self.threads)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if isinstance(self.data_parallel, bool) or not isinstance(self.data_parallel, int) or self.data_parallel < 1:
            raise ConfigError(f"--data-parallel {self.data_parallel!r}: give a whole number >= 1")
        if self.cores_per_replica is not None and self.cores_per_replica < 1:
            raise ConfigError(f"--cores-per-replica {self.cores_per_replica}: give at least 1")
        if self.router_policy not in POLICIES:
            raise ConfigError(f"--router-policy {self.router_policy!r}: use one of {', '.join(POLICIES)}")
        if self.data_parallel > 1 and self.server.grpc_port is not None:
            raise ConfigError("--grpc-port with --data-parallel: the replicas' router speaks HTTP only; serve one "
                              "replica per `llmopt serve --grpc-port` behind a gRPC load balancer instead")

    @classmethod
    def from_values(cls, o: dict) -> ServeConfig:
        """The config for every option's value (the command's names; see OPTIONS)."""
        speculative = speculative_config(o["speculative"], o["num_speculative_tokens"], o["speculative_config"])
        engine = EngineConfig(**{name: o[name] for name in ENGINE_OPTIONS}, speculative=speculative)
        server = {name: o[name] for name in SERVER_OPTIONS}
        server |= {f"{name}_s": o[name] for name in SERVER_SECONDS}
        if o["api_keys_file"] is not None and (o["api_key"] is not None or o["api_key_file"] is not None):
            raise ConfigError("give --api-keys-file (keys with their tenants) or --api-key / --api-key-file / "
                              "$LLMOPT_API_KEY (one key), not both")
        server["api_key"] = read_api_key(o["api_key"], o["api_key_file"])
        server["tenants"] = read_tenants(o["api_keys_file"]) if o["api_keys_file"] is not None else ()
        if o["served_model_name"] is not None:  # None: the command names the model after its SOURCE
            server["served_model_name"] = o["served_model_name"]
        tp = TPOptions(o["nnodes"], o["node_rank"], o["master_addr"], o["master_port"])
        return cls(engine, ServerConfig(**server), o["device"], o["dtype"], o["backend"], tp, o["threads"],
                   o["tensor_parallel_size"], o["data_parallel"], o["cores_per_replica"], o["router_policy"])


ENGINE_OPTIONS = ("block_size", "kv_cache_memory", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
                  "max_model_len",
                  "max_batch_size", "max_wait_ms", "enforce_eager")
SERVER_OPTIONS = ("host", "port", "grpc_port", "metrics_public", "max_queued_requests", "max_queued_tokens", "max_body_bytes",
                  "max_connections", "log_json")
SERVER_SECONDS = ("request_timeout", "drain_grace", "drain_timeout", "header_timeout", "keep_alive_timeout")


def read_api_key(given: str | None, path: str | None) -> str | None:
    """The key from --api-key (or $LLMOPT_API_KEY), or read from --api-key-file, which keeps it out of
    `ps` and the shell's history: the file's text without surrounding whitespace."""
    if path is None:
        return given
    if given is not None:
        raise ConfigError("give the API key once: --api-key-file, or --api-key / $LLMOPT_API_KEY, not both")
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e.__class__.__name__
        raise ConfigError(f"--api-key-file {path}: cannot read it ({reason})") from None
    if not key:
        raise ConfigError(f"--api-key-file {path}: the file is empty")
    if any(c.isspace() for c in key):
        raise ConfigError(f"--api-key-file {path}: the key must be one word (the file holds whitespace inside it)")
    return key


def options_from_file(path, source: str, schema: Options | None = None) -> dict:
    """`llmopt serve --config FILE` (as `vllm serve --config`): a YAML mapping of option names (as the long
    flags: max-num-seqs, --max-num-seqs or max_num_seqs) to values, each checked against its option; an
    unknown name is refused. A `model` key, as vLLM's files may hold, must name SOURCE."""
    import yaml

    schema = schema or OPTIONS
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror or type(e).__name__})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({' '.join(str(e).split())})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option names to values")
    values = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name == "model":
            if str(value) != source:
                raise ConfigError(f"--config {path}: model {value!r} is not SOURCE {source!r}; give one model")
            continue
        if name not in schema:
            raise ConfigError(f"--config {path}: {key!r} is no option of llmopt serve (llmopt serve --help)")
        if schema[name].kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # kv-cache-memory: 0.5 reads as a number
        values[name] = schema[name].check(value)
    return values


DEFAULTS = ServeConfig()  # what every option is when not given: the command line reads its defaults here
_E, _S, _T = DEFAULTS.engine, DEFAULTS.server, DEFAULTS.tp
OPTIONS = Options(  # in `llmopt serve`'s order
    Option("host", str, _S.host), Option("port", int, _S.port), Option("grpc_port", int, _S.grpc_port, optional=True),
    Option("api_key", str, _S.api_key, optional=True),
    Option("api_key_file", str, None, optional=True), Option("api_keys_file", str, None, optional=True),
    Option("served_model_name", str, None, optional=True), Option("metrics_public", bool, _S.metrics_public),
    Option("max_queued_requests", int, _S.max_queued_requests), Option("max_queued_tokens", int, _S.max_queued_tokens),
    Option("max_body_bytes", int, _S.max_body_bytes),
    Option("request_timeout", float, _S.request_timeout_s, optional=True),
    Option("drain_grace", float, _S.drain_grace_s), Option("drain_timeout", float, _S.drain_timeout_s),
    Option("header_timeout", float, _S.header_timeout_s),
    Option("keep_alive_timeout", float, _S.keep_alive_timeout_s), Option("max_connections", int, _S.max_connections),
    Option("log_json", bool, _S.log_json),
    Option("block_size", int, _E.block_size), Option("kv_cache_memory", str, _E.kv_cache_memory, optional=True),
    Option("gpu_memory_utilization", float, _E.gpu_memory_utilization, optional=True),
    Option("max_num_seqs", int, _E.max_num_seqs), Option("max_num_batched_tokens", int, _E.max_num_batched_tokens),
    Option("max_model_len", int, _E.max_model_len, optional=True),
    Option("max_batch_size", int, _E.max_batch_size, optional=True), Option("max_wait_ms", float, _E.max_wait_ms),
    Option("enforce_eager", bool, _E.enforce_eager),
    Option("speculative", str, None, optional=True), Option("num_speculative_tokens", int, None, optional=True),
    Option("speculative_config", str, None, optional=True),
    Option("device", str, DEFAULTS.device), dtype_option(DEFAULTS.dtype),
    Option("backend", str, DEFAULTS.backend, choices=BACKENDS),
    Option("nnodes", int, _T.nnodes), Option("node_rank", int, _T.node_rank), Option("master_addr", str, _T.master_addr),
    Option("master_port", int, _T.master_port, optional=True),
    Option("tensor_parallel_size", int, DEFAULTS.tensor_parallel_size), Option("threads", int, None, optional=True),
    Option("data_parallel", int, DEFAULTS.data_parallel),
    Option("cores_per_replica", int, DEFAULTS.cores_per_replica, optional=True),
    Option("router_policy", str, DEFAULTS.router_policy, choices=POLICIES),
)
ServeConfig.OPTIONS = OPTIONS
