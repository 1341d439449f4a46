"""Backpressure: a request is admitted only while the server's queue has room, else 503 at once.

The server holds at most `capacity` running sequences (the engine's batch) plus
`max_queued_requests` waiting ones, and at most `max_queued_tokens` prompt tokens that have not
produced a first token yet (waiting or still in prefill). A request that is over a bound gets 503
with Retry-After without touching the engine; nothing ever waits in an unbounded queue. The counts
are the engine's own (`AsyncEngine.load`): admission keeps only its limits and its refusals.
"""
from __future__ import annotations

from collections import Counter

from .config import ServerConfig
from .errors import APIError, bad_request


class Admission:
    """The server's queue bounds over the engine's load, and the count of 503s by code."""

    def __init__(self, config: ServerConfig, engine):
        self.engine = engine  # an AsyncEngine: its load() is safe to read from the event loop
        self.capacity = engine.config.seqs_per_step
        self.max_queued_requests = config.max_queued_requests
        self.max_queued_tokens = config.max_queued_tokens
        self.retry_after = str(config.retry_after_s)
        self.rejected: Counter[str] = Counter()  # 503s by code

    @property
    def limit(self) -> int:
        return self.capacity + self.max_queued_requests

    @property
    def in_flight(self) -> int:
        """Sequences the engine holds or has been handed, not yet finished."""
        return self.engine.load()[0]

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens of those sequences without a first output token."""
        return self.engine.load()[1]

    def admit(self, prompt_lengths: list[int]) -> None:
        """Return if these sequences (one per prompt length) may be submitted now; else APIError:
        400 for a request that could never fit, 503 for one that does not fit now. Submit them
        before the next `await`, so that the next request's admission counts them."""
        n, tokens = len(prompt_lengths), sum(prompt_lengths)
        if n > self.limit:
            raise bad_request(f"this request asks for {n} sequences but the server holds at most {self.limit} "
                              f"({self.capacity} running + {self.max_queued_requests} queued); lower n or send "
                              "fewer prompts at once", "n")
        in_flight, queued_tokens = self.engine.load()
        if in_flight + n > self.limit:
            self._busy(f"the server is at its limit of {self.limit} sequences ({self.capacity} running + "
                       f"{self.max_queued_requests} queued); retry later", "queue_full")
        if queued_tokens and queued_tokens + tokens > self.max_queued_tokens:
            self._busy(f"{queued_tokens} prompt tokens are already queued; this request's {tokens} would pass "
                       f"the limit of {self.max_queued_tokens}; retry later", "queue_tokens_full")

    def _busy(self, message: str, code: str):
        self.rejected[code] += 1
        raise APIError(503, message, code=code, headers={"Retry-After": self.retry_after})
