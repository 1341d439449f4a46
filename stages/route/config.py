"""RouteConfig: the router's replicas, policy, health checks and limits (every default once, here)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError

POLICIES = ("round-robin", "least-load", "cache-aware")


@dataclass(frozen=True)
class RouteConfig:
    replicas: tuple[str, ...] = field(default_factory=tuple)  # base URLs, http://host:port
    policy: str = "cache-aware"
    host: str = "127.0.0.1"
    port: int = 8080
    health_interval_s: float = 1.0  # GET /health of every replica this often
    eject_after: int = 3  # failed checks in a row before a replica is taken out (a refused connection: at once)
    balance_abs: int = 8  # cache-aware: when the busiest replica has this many more requests in flight ...
    balance_rel: float = 1.5  # ... and this many times the idlest's (+1), route by load instead
    match_ratio: float = 0.5  # cache-aware: below this share of the prompt matched, prefer the emptiest tree
    tree_chars: int = 2_000_000  # cache-aware: characters kept per replica's tree (oldest prompts dropped)
    retries: int = 2  # other replicas tried for a request that failed before its first byte
    timeout_s: float = 600.0  # per request to a replica
    retry_after_s: int = 1  # Retry-After of a 503 when no replica is healthy

    def validate(self) -> None:
        if not self.replicas:
            raise ConfigError("give at least one --replica URL (http://host:port of an llmopt serve)")
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"--replica {url!r}: give a URL, http://host:port")
        if len(set(self.replicas)) != len(self.replicas):
            raise ConfigError("--replica: each replica once")
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        if self.health_interval_s <= 0 or self.eject_after < 1 or self.retries < 0:
            raise ConfigError("--health-interval must be positive, --eject-after at least 1, --retries at least 0")
        if self.balance_abs < 0 or self.balance_rel < 1 or not 0 <= self.match_ratio <= 1:
            raise ConfigError("--balance-abs must be at least 0, --balance-rel at least 1, --cache-threshold in [0, 1]")
