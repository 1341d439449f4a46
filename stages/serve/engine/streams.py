"""Streams: where the AsyncEngine's loop thread sends each request's outputs.

One asyncio queue per request, with the event loop that reads it; items go in through
`loop.call_soon_threadsafe`, never by touching the queue from the loop thread. Not locked itself:
the AsyncEngine calls it under its own lock.
"""
from __future__ import annotations

import asyncio

from .engine import RequestOutput

Target = tuple[asyncio.AbstractEventLoop, asyncio.Queue]


class Streams:
    """The open stream of every request handed to the loop thread and not yet finished."""

    def __init__(self):
        self._targets: dict[str, Target] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._targets

    def open(self, request_id: str) -> asyncio.Queue:
        """A queue for `request_id`'s outputs, read from the running event loop (call from it)."""
        queue: asyncio.Queue = asyncio.Queue()
        self._targets[request_id] = (asyncio.get_running_loop(), queue)
        return queue

    def deliver(self, outputs: list[RequestOutput]) -> list[str]:
        """Send each output to its stream (a finished one closes it); the ids of unfinished
        requests whose event loop is gone, which nobody will read any more."""
        orphans = []
        for out in outputs:
            target = self._targets.pop(out.request_id) if out.finished else self._targets.get(out.request_id)
            if target is not None and not send(target, out) and not out.finished:
                del self._targets[out.request_id]
                orphans.append(out.request_id)
        return orphans

    def close_all(self) -> list[Target]:
        """Forget every stream; their targets, for the caller to fail outside the lock."""
        targets, self._targets = list(self._targets.values()), {}
        return targets


def send(target: Target, item) -> bool:
    """Put `item` on a stream's queue from any thread; False if its event loop is closed."""
    loop, queue = target
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:  # that event loop is closed
        return False
    return True
