"""ServerConfig: how the HTTP layer admits, limits, authenticates and logs requests."""
from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import ConfigError
from .tenants import Tenant


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless asked: an open port serves anyone who can reach it
    port: int = 8000
    grpc_port: int | None = None  # also serve the gRPC API (stages/serve/rpc) on this port of `host`
    served_model_name: str = "model"
    api_key: str | None = field(default=None, repr=False)  # when set, every route but /health needs it as Bearer
    tenants: tuple[Tenant, ...] = field(default=(), repr=False)  # --api-keys-file: keys with their own limits
    metrics_public: bool = False  # /metrics without the key
    max_queued_requests: int = 256  # sequences waiting beyond the running batch; more get 503
    max_queued_tokens: int = 262_144  # prompt tokens not yet prefilled; more get 503
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout_s: float | None = None  # a request still running after this is aborted
    drain_grace_s: float = 5.0  # on SIGTERM, how long to go on accepting (answering 503) before the port closes
    drain_timeout_s: float = 30.0  # then how long in-flight requests may finish before they are aborted
    header_timeout_s: float = 10.0  # a connection's request headers, and each stall in a body, at most
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 1024  # open connections; a request on one past this gets 503 at once
    retry_after_s: int = 1  # the Retry-After header of a 503
    log_json: bool = False  # access log as JSON lines

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535 (got {self.port})")
        if self.grpc_port is not None and not 0 <= self.grpc_port <= 65535:
            raise ConfigError(f"--grpc-port must be in 0..65535 (got {self.grpc_port})")
        if self.grpc_port is not None and self.grpc_port == self.port != 0:
            raise ConfigError(f"--grpc-port {self.grpc_port} is the HTTP --port too; give them different ports")
        _at_least("--max-queued-requests", self.max_queued_requests, 0)
        _at_least("--max-queued-tokens", self.max_queued_tokens, 1)
        _at_least("--max-body-bytes", self.max_body_bytes, 1)
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ConfigError(f"--request-timeout must be > 0 seconds (got {self.request_timeout_s})")
        for name, seconds in (("--drain-grace", self.drain_grace_s), ("--drain-timeout", self.drain_timeout_s)):
            if seconds < 0:
                raise ConfigError(f"{name} must be >= 0 seconds (got {seconds})")
        for name, seconds in (("--header-timeout", self.header_timeout_s),
                              ("--keep-alive-timeout", self.keep_alive_timeout_s)):
            if seconds <= 0:
                raise ConfigError(f"{name} must be > 0 seconds (got {seconds})")
        _at_least("--max-connections", self.max_connections, 1)
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key must not be empty")
        if self.api_key is not None and self.tenants:
            raise ConfigError("give --api-key (or --api-key-file, $LLMOPT_API_KEY) or --api-keys-file, not both")
        if not self.served_model_name:
            raise ConfigError("--served-model-name must not be empty")

    def bearer_keys(self) -> dict[str, str | None]:
        """Every accepted key and its tenant's name (None for the one --api-key); empty: no auth."""
        if self.tenants:
            return {t.key: t.name for t in self.tenants}
        return {self.api_key: None} if self.api_key is not None else {}


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"{name} must be at least {low} (got {value})")
