"""The bench's configuration and the parsing of what users type (--request-rate, --slo, --url, --grpc)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..errors import ConfigError
from ..grpc_api import SERVICE

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
GRPC_AUTO = "auto"  # --grpc auto: bench over the gRPC port of the server the bench starts
GRPC_METHOD = f"/{SERVICE}/GenerateStream"  # the call each request makes over gRPC
SLO_KEYS = {"ttft_ms": "ttft_ms", "tpot_ms": "tpot_ms", "e2e_ms": "e2el_ms", "e2el_ms": "e2el_ms"}


@dataclass(frozen=True)
class BenchConfig:
    """How to drive the server: where, which endpoint, how fast, and what counts as good."""

    url: str | None = None  # the server's base URL; None until known (a bench stage starts its server first)
    # HOST:PORT of the server's gRPC API: requests go there (GenerateStream) instead of over HTTP; "auto" until
    # the bench stage has started its server with a gRPC port; None: HTTP.
    grpc: str | None = None
    endpoint: str = "completions"
    model: str | None = None  # None: the first the server lists (GET /v1/models or ListModels), else none is sent
    api_key: str | None = None
    request_rate: float = math.inf  # requests per second; inf sends them all at once
    burstiness: float = 1.0  # gamma shape of the inter-arrival times; 1 is a Poisson process
    max_concurrency: int | None = None
    warmup: int = 1
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float = 600.0  # per request, between bytes of the stream
    slo: dict[str, float] = field(default_factory=dict)  # {"ttft_ms": .., "tpot_ms": .., "e2el_ms": ..}

    def validate(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ConfigError(f"--endpoint {self.endpoint}: use one of {', '.join(ENDPOINTS)}")
        if not self.request_rate > 0:
            raise ConfigError(f"--request-rate {self.request_rate}: give a positive rate or inf")
        if not 0 < self.burstiness < math.inf:
            raise ConfigError(f"--burstiness {self.burstiness}: give a positive number (1 = Poisson)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError(f"--max-concurrency {self.max_concurrency}: give at least 1")
        if self.warmup < 0 or self.timeout_s <= 0:
            raise ConfigError("--warmup must be >= 0 and --timeout > 0")
        if self.grpc:
            normalize_grpc_target(self.grpc)

    @property
    def protocol(self) -> str:
        """How requests travel: "grpc" or "http"."""
        return "grpc" if self.grpc else "http"

    @property
    def api_url(self) -> str:
        return self.url + ENDPOINTS[self.endpoint]

    @property
    def target(self) -> str:
        """Where each request goes: the endpoint's URL, or the gRPC method at grpc://HOST:PORT."""
        return f"grpc://{self.grpc}{GRPC_METHOD}" if self.grpc else self.api_url

    def describe(self) -> dict:
        """The run's settings as the report stores them (vLLM writes an infinite rate as "inf"). Over gRPC the
        base URL is grpc://HOST:PORT and `endpoint` still names the HTTP endpoint whose fields the requests
        carry (a text prompt or one chat message), so reports of both protocols compare."""
        base_url = f"grpc://{self.grpc}" if self.grpc else self.url
        return {"protocol": self.protocol, "base_url": base_url, "endpoint": ENDPOINTS[self.endpoint],
                "model_id": self.model,
                "request_rate": "inf" if math.isinf(self.request_rate) else self.request_rate,
                "burstiness": self.burstiness, "max_concurrency": self.max_concurrency,
                "warmup": self.warmup, "seed": self.seed, "temperature": self.temperature,
                "ignore_eos": self.ignore_eos, "slo": dict(self.slo) or None}


def parse_rate(text: str) -> float:
    """'inf' or a positive number of requests per second."""
    try:
        rate = float(text)
    except ValueError:
        raise ConfigError(f"--request-rate {text!r}: give requests per second (e.g. 4) or inf") from None
    if not rate > 0:
        raise ConfigError(f"--request-rate {text!r}: give a positive rate or inf")
    return rate


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft_ms=500,tpot_ms=50,e2e_ms=3000' -> {'ttft_ms': 500.0, 'tpot_ms': 50.0, 'e2el_ms': 3000.0}."""
    slo: dict[str, float] = {}
    for part in _items(text):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise ConfigError(f"--slo {part!r}: write KEY=MS with KEY one of ttft_ms, tpot_ms, e2e_ms "
                              "(e.g. --slo ttft_ms=500,tpot_ms=50)")
        slo[SLO_KEYS[key]] = _positive(value, f"--slo {key}")
    return slo


def goodput_as_slo(items: list[str] | None, slo: str | None = None) -> str | None:
    """vLLM's --goodput KEY:MS ... (ttft, tpot, e2el; one flag per item, or several in one string) as
    --slo's text, after `slo`'s own items: ['ttft:500', 'tpot:50'] -> 'ttft_ms=500,tpot_ms=50'."""
    parts = [p for item in items or () for p in item.replace(",", " ").split()]
    for part in parts:
        key, sep, value = part.partition(":")
        if not sep or f"{key}_ms" not in SLO_KEYS:
            raise ConfigError(f"--goodput {part!r}: write KEY:MS with KEY one of ttft, tpot, e2el "
                              "(e.g. --goodput ttft:500 --goodput tpot:50)")
    text = ",".join([*_items(slo), *(f"{k}_ms={v}" for k, _, v in (p.partition(":") for p in parts))])
    return text or None


def normalize_url(url: str) -> str:
    """The server's base URL: scheme and host, without a trailing '/', '/v1' or endpoint path."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--url {url!r}: give the server's base URL, e.g. http://127.0.0.1:8000")
    base = url.strip().rstrip("/")
    for suffix in (*ENDPOINTS.values(), "/v1"):  # the API root or an endpoint's URL both name the server
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def normalize_grpc_target(target: str) -> str:
    """--grpc's value: a gRPC server's HOST:PORT (a leading grpc:// is dropped; an IPv6 host goes in brackets),
    or "auto"."""
    text = target.strip().removeprefix("grpc://").rstrip("/")
    if text == GRPC_AUTO:
        return GRPC_AUTO
    host, sep, port = text.rpartition(":")
    bare_ipv6 = ":" in host and not (host.startswith("[") and host.endswith("]"))
    if not sep or not host or bare_ipv6 or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"--grpc {target!r}: give HOST:PORT of the server's gRPC API with a port in 1..65535, "
                          f"e.g. 127.0.0.1:50051 (or --grpc auto with --server)")
    return f"{host}:{int(port)}"


def _items(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def _positive(value: str, what: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{what}={value!r}: not a number") from None
    if not 0 < number < math.inf:
        raise ConfigError(f"{what}={value!r}: give a positive number")
    return number

