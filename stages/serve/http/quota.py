"""Per-tenant limits: requests in flight and tokens per minute, checked before the server's queue.

Tokens: a request reserves what it may use at most — its prompt tokens plus max_tokens for each
sequence (with no max_tokens, up to the model's length) — from its tenant's token bucket, which holds
`tokens_per_minute` and refills evenly over a minute. When the request ends (finished, aborted, client
gone) the bucket gets back what was not generated. So a tenant never runs past its limit, at the price
of holding the budget of a long max_tokens while it runs. A tenant over a limit gets 429 with
Retry-After; one request that could never fit the bucket gets 400.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

from .errors import APIError
from .tenants import Tenant


class TokenBucket:
    """`per_minute` tokens, refilled at per_minute / 60 a second up to per_minute."""

    def __init__(self, per_minute: int, clock):
        self.capacity, self.rate, self.clock = per_minute, per_minute / 60.0, clock
        self.level, self.at = float(per_minute), clock()

    def take(self, n: int) -> float:
        """Take `n` tokens and return 0, or take none and return the seconds until `n` are there."""
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now
        if n <= self.level:
            self.level -= n
            return 0.0
        return (n - self.level) / self.rate

    def give_back(self, n: int) -> None:
        self.level = min(self.capacity, self.level + n)


@dataclass
class TenantUsage:
    """One tenant's live counts, read by /metrics."""
    tenant: Tenant
    bucket: TokenBucket | None
    in_flight: int = 0
    tokens: int = 0  # prompt + generated tokens of the requests that ended
    outcomes: Counter = field(default_factory=Counter)


class Lease:
    """An admitted request's hold on its tenant: one slot and the tokens reserved; `release` once it ends."""

    def __init__(self, usage: TenantUsage, reserved: int):
        self.usage, self.reserved, self.released = usage, reserved, False

    def release(self, used: int) -> None:
        """Free the slot and give back the reserved tokens not `used` (again: nothing)."""
        if self.released:
            return
        self.released = True
        self.usage.in_flight -= 1
        self.usage.tokens += used
        if self.usage.bucket is not None:
            self.usage.bucket.give_back(max(0, self.reserved - used))


class Quotas:
    """Every tenant's usage; `acquire` admits a request or raises its 429 (or 400)."""

    def __init__(self, tenants: tuple[Tenant, ...], retry_after_s: int, clock=time.monotonic):
        self.retry_after_s = retry_after_s
        self.usage = {t.name: TenantUsage(t, TokenBucket(t.tokens_per_minute, clock) if t.tokens_per_minute else None)
                      for t in tenants}

    def acquire(self, tenant: str | None, tokens: int) -> Lease | None:
        """A lease for a request of `tenant` that may use `tokens`; None for a server without tenants."""
        usage = self.usage.get(tenant) if tenant is not None else None
        if usage is None:
            return None
        limit = usage.tenant.max_concurrency
        if limit is not None and usage.in_flight >= limit:
            self._refuse(usage, "concurrency_limited", "requests", self.retry_after_s,
                         f"tenant {tenant!r} has {usage.in_flight} requests in flight, its max_concurrency of {limit}; "
                         "retry when one has finished")
        if usage.bucket is not None:
            per_minute = usage.tenant.tokens_per_minute
            if tokens > per_minute:
                raise APIError(400, f"this request may use {tokens} tokens (prompt + max_tokens), more than tenant "
                               f"{tenant!r}'s tokens_per_minute of {per_minute}; lower max_tokens", "max_tokens",
                               "tokens_over_tenant_limit")
            wait = usage.bucket.take(tokens)
            if wait:
                self._refuse(usage, "rate_limited", "tokens", max(1, math.ceil(wait)),
                             f"tenant {tenant!r} is over its tokens_per_minute of {per_minute}: this request may use "
                             f"{tokens} tokens (prompt + max_tokens); retry in {math.ceil(wait)} s or lower max_tokens")
        usage.in_flight += 1
        usage.outcomes["admitted"] += 1
        return Lease(usage, tokens)

    def _refuse(self, usage: TenantUsage, outcome: str, kind: str, retry_after: int, message: str):
        usage.outcomes[outcome] += 1
        raise APIError(429, message, code="rate_limit_exceeded", type=kind,
                       headers={"Retry-After": str(retry_after)})

    def snapshot(self) -> list[TenantUsage]:
        return list(self.usage.values())
