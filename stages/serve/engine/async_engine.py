"""AsyncEngine: the LLMEngine loop in a thread of its own, with an async stream per request.

asyncio code (the HTTP server) never waits on the model: `add_request` checks the request in the
caller's thread (so a bad one fails at once), hands it to the loop thread, and returns an async
iterator fed through `loop.call_soon_threadsafe`. Only the loop thread touches the LLMEngine.
If that thread dies, every waiting stream raises EngineDeadError and `is_healthy` turns False.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator

from ...errors import LlmoptError
from .config import RequestRejected, SamplingParams
from .engine import LLMEngine, RequestOutput


class EngineDeadError(LlmoptError):
    """The engine loop is not running (it failed, or was shut down): restart the server."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Condition()
        self._commands: deque[tuple] = deque()  # ("add", Sequence) | ("abort", request_id), in order
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="llmopt-engine", daemon=True)
        self._thread.start()

    @property
    def is_healthy(self) -> bool:
        return self.error is None and not self._stopping and self._thread.is_alive()

    def stats(self):
        return self.engine.stats()

    # --- the asyncio side -----------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None = None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request (call from a coroutine); iterate the result for its outputs. Raises
        RequestRejected for a request that can never run, EngineDeadError if the loop is down."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        seq = self.engine.make_sequence(request_id, prompt, params, prompt_token_ids)
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._check_alive()  # again, under the lock: a loop that dies now still fails this stream
            if seq.request_id in self._streams:
                raise RequestRejected(f"request id {seq.request_id!r} is already in use; give each request its own id")
            self._streams[seq.request_id] = (loop, queue)
            self._commands.append(("add", seq))
            self._lock.notify()
        return self._stream(seq.request_id, queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, RequestRejected):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped: {item.__class__.__name__}: {item}") from item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the consumer went away (a client disconnect): stop the work
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._commands.append(("abort", str(request_id)))
            self._lock.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop after the current step; open streams raise EngineDeadError."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout)
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an error ({self.error.__class__.__name__}: "
                                  f"{self.error}); restart it")
        if self._stopping or not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down")

    # --- the loop thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._wait_for_work():
                self._deliver(self.engine.step())
        except BaseException as e:  # anything at all: every waiter must hear of it
            self.error = e
            self._fail_all(e)

    def _wait_for_work(self) -> bool:
        """Apply queued commands and block until there is a step to run (False: shut down). With
        max_wait_ms, an idle engine waits for a short queue to fill a batch, up to the deadline."""
        with self._lock:
            while not self._stopping:
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._lock.wait()
                    continue
                wait = self.engine.scheduler.fill_wait_s()
                if wait <= 0:
                    return True
                self._lock.wait(wait)
            return False

    def _apply_commands(self) -> None:
        while self._commands:
            kind, arg = self._commands.popleft()
            if kind == "add":
                try:
                    self.engine.add_sequence(arg)
                except RequestRejected as e:
                    self._send(self._streams.pop(arg.request_id), e)
            else:
                final = self.engine.abort(arg)
                self._deliver([final] if final else [], locked=True)

    def _deliver(self, outputs: list[RequestOutput], locked: bool = False) -> None:
        if not outputs:
            return
        if not locked:
            with self._lock:
                return self._deliver(outputs, locked=True)
        for out in outputs:
            target = self._streams.pop(out.request_id) if out.finished else self._streams.get(out.request_id)
            if target is not None and not self._send(target, out) and not out.finished:
                del self._streams[out.request_id]  # its event loop is gone: nobody will read the rest
                self._commands.append(("abort", out.request_id))

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            targets, self._streams = list(self._streams.values()), {}
        for target in targets:
            self._send(target, error)

    @staticmethod
    def _send(target: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item) -> bool:
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # that event loop is closed
            return False
        return True
