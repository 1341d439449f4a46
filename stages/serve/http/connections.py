"""Connection limits that uvicorn does not set: a deadline for request headers, a cap on open connections.

uvicorn's own `timeout_keep_alive` closes an idle keep-alive connection, and a body that stalls gets
408 from the app (middleware.BodyTimeout). What is left lives here, in a subclass of uvicorn's h11
protocol, as nginx's `client_header_timeout` and envoy's connection limit do it:

- A connection has `header_timeout_s` from its first byte (or from its opening, for a fresh one) to
  complete its request headers; one that has not (a slowloris client, trickling a byte at a time) is
  closed. The clock starts again with each request on a keep-alive connection.
- A client that goes on sending a body the app has already answered without reading (a 404, /health)
  gets the same time from its next byte to send the rest, then the connection is closed.
- Past `max_connections` open connections, a request on a new one is answered by `refuse` (503 and
  `Connection: close`) as soon as its headers are in, without reaching the app.
"""
from __future__ import annotations

import asyncio
from typing import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def guarded_protocol(header_timeout_s: float, max_connections: int, refuse: Callable) -> type[H11Protocol]:
    """uvicorn's h11 protocol with these limits (pass it as uvicorn.Config's `http`)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "header_timeout_s": header_timeout_s, "max_connections": max_connections, "refuse": staticmethod(refuse)})


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with one timer per connection: the headers' deadline, or that of the rest of a body
    nobody reads any more."""

    header_timeout_s: float = 10.0
    max_connections: int = 1024
    refuse: Callable  # an ASGI app answering a connection past the limit

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.app = self.refuse  # h11_impl runs `self.app` for each request on this connection
        self._arm(self._headers_late)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            self._disarm()
        elif self.conn.their_state is h11.IDLE:  # a request's headers have begun and are not complete
            if self.deadline is None:
                self._arm(self._headers_late)
        elif self.conn.their_state is h11.SEND_BODY and self._answered():
            if self.deadline is None:  # the rest of a body nobody reads: one deadline for all of it
                self._arm(self._body_late)
        else:  # headers complete: the app reads the body, with its own timeout
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _answered(self) -> bool:
        return self.cycle is not None and self.cycle.response_complete

    def _arm(self, callback: Callable[[], None]) -> None:
        self.deadline = self.loop.call_later(self.header_timeout_s, callback)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _headers_late(self) -> None:
        self.deadline = None
        waiting = self.cycle is None or self.cycle.response_complete  # not inside a request
        if waiting and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def _body_late(self) -> None:
        self.deadline = None
        if self.conn.their_state is h11.SEND_BODY and self._answered() and not self.transport.is_closing():
            self.transport.close()
