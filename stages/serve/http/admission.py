"""Backpressure: a request is admitted only while the server's queue has room, else 503 at once.

The server holds at most `capacity` running sequences (the engine's batch) plus
`max_queued_requests` waiting ones, and at most `max_queued_tokens` prompt tokens that have not
produced a first token yet (waiting or still in prefill). A request that is over a bound gets 503
with Retry-After without touching the engine; nothing ever waits in an unbounded queue.
"""
from __future__ import annotations

from collections import Counter

from .config import ServerConfig
from .errors import APIError, bad_request


class Admission:
    def __init__(self, config: ServerConfig, capacity: int):
        self.capacity = capacity
        self.max_queued_requests = config.max_queued_requests
        self.max_queued_tokens = config.max_queued_tokens
        self.retry_after = str(config.retry_after_s)
        self.in_flight = 0  # sequences admitted and not yet finished
        self.queued_tokens = 0  # prompt tokens of admitted sequences without a first token
        self.rejected: Counter[str] = Counter()  # 503s by code

    @property
    def limit(self) -> int:
        return self.capacity + self.max_queued_requests

    def admit(self, prompt_lengths: list[int]) -> Ticket:
        """A ticket for these sequences (one per prompt length), or APIError: 400 for a request that
        could never fit, 503 for one that does not fit now."""
        n, tokens = len(prompt_lengths), sum(prompt_lengths)
        if n > self.limit:
            raise bad_request(f"this request asks for {n} sequences but the server holds at most {self.limit} "
                              f"({self.capacity} running + {self.max_queued_requests} queued); lower n or send "
                              "fewer prompts at once", "n")
        if self.in_flight + n > self.limit:
            self._busy(f"the server is at its limit of {self.limit} sequences ({self.capacity} running + "
                       f"{self.max_queued_requests} queued); retry later", "queue_full")
        if self.queued_tokens and self.queued_tokens + tokens > self.max_queued_tokens:
            self._busy(f"{self.queued_tokens} prompt tokens are already queued; this request's {tokens} would pass "
                       f"the limit of {self.max_queued_tokens}; retry later", "queue_tokens_full")
        self.in_flight += n
        self.queued_tokens += tokens
        return Ticket(self, prompt_lengths)

    def _busy(self, message: str, code: str):
        self.rejected[code] += 1
        raise APIError(503, message, code=code, headers={"Retry-After": self.retry_after})


class Ticket:
    """One request's place in the server; `start(i)` when sequence i yields its first output,
    `close()` once (when the request ends however it ends)."""

    def __init__(self, admission: Admission, prompt_lengths: list[int]):
        self.admission = admission
        self.size = len(prompt_lengths)
        self.unstarted = dict(enumerate(prompt_lengths))
        self.open = True

    def start(self, index: int) -> None:
        tokens = self.unstarted.pop(index, None)
        if tokens is not None and self.open:
            self.admission.queued_tokens -= tokens

    def close(self) -> None:
        if self.open:
            self.open = False
            self.admission.in_flight -= self.size
            self.admission.queued_tokens -= sum(self.unstarted.values())
