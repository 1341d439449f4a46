"""AsyncEngine: the LLMEngine loop in a thread of its own, with an async stream per request.

asyncio code (the HTTP server) never calls into the LLMEngine: it checks a request with
`validate` (immutable facts only, so a bad request fails at once in the caller's thread), hands it
to the loop thread as a command, and reads an async iterator fed through
`loop.call_soon_threadsafe`. Only the loop thread touches the LLMEngine; after every step it
publishes the engine's stats, which `stats()` and `load()` read under the lock.
If that thread dies, every waiting stream raises EngineDeadError and `is_healthy` turns False.
"""
from __future__ import annotations

import asyncio
import copy
import threading
from collections import deque
from collections.abc import AsyncIterator

from ...errors import LlmoptError
from .config import RequestRejected, SamplingParams
from .engine import EngineStats, LLMEngine, RequestOutput
from .request import Request, prompt_ids
from .streams import Streams, send


class EngineDeadError(LlmoptError):
    """The engine loop is not running (it failed, or was shut down): restart the server."""


class AsyncEngine:
    """Drives an LLMEngine from a loop thread; the methods above `_run` are for the asyncio side."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine  # the loop thread's alone once it runs
        self.config = engine.config  # resolved and frozen: safe to read anywhere
        self._checker = engine.checker  # immutable, like the config it reads
        # Requests are tokenized here while the loop thread detokenizes: each side has its own
        # tokenizer, as the Rust tokenizer object refuses concurrent use from two threads.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self._lock = threading.Condition()
        self._commands: deque[tuple] = deque()  # ("add", Request) | ("abort", request_id), in order
        self._streams = Streams()  # where each request's outputs go
        self._stats = engine.stats()  # as of the loop thread's last step or command
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="llmopt-engine", daemon=True)
        self._thread.start()

    @property
    def is_healthy(self) -> bool:
        return self.error is None and not self._stopping and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step (or its last applied command)."""
        with self._lock:
            return self._stats

    def load(self) -> tuple[int, int]:
        """(unfinished sequences, prompt tokens without an output token yet) the engine holds or has
        been handed and not yet taken in: what the server's admission bounds."""
        with self._lock:
            handed = [arg for kind, arg in self._commands if kind == "add"]
            return (self._stats.num_running + self._stats.num_waiting + len(handed),
                    self._stats.num_queued_prompt_tokens + sum(len(r.prompt_token_ids) for r in handed))

    # --- the asyncio side -----------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        """Raise RequestRejected for a request that could never run (the engine's one check)."""
        self._checker.check(prompt_token_ids, params or SamplingParams())

    def make_request(self, request_id: str, prompt: str | None = None, params: SamplingParams | None = None,
                     prompt_token_ids: list[int] | None = None) -> Request:
        """A checked Request (see `validate`), to `submit` later."""
        return self._checker.request(request_id, prompt_ids(self.tokenizer, prompt, prompt_token_ids), params)

    def submit(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Queue a request made by `make_request` (call from a coroutine); iterate the result for its
        outputs. Raises RequestRejected for an id in use, EngineDeadError if the loop is down."""
        self._check_alive()
        with self._lock:
            self._check_alive()  # again, under the lock: a loop that dies now still fails this stream
            if request.request_id in self._streams:
                raise RequestRejected(f"request id {request.request_id!r} is already in use; give each request "
                                      "its own id")
            queue = self._streams.open(request.request_id)
            self._commands.append(("add", request))
            self._lock.notify()
        return self._stream(request.request_id, queue)

    def add_request(self, request_id: str, prompt: str | None = None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        """`submit(make_request(...))`: check and queue one request."""
        return self.submit(self.make_request(request_id, prompt, params, prompt_token_ids))

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped: {item.__class__.__name__}: {item}") from item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the consumer went away (a client disconnect): stop the work
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request (its stream ends with an "abort" output); a finished or unknown one is left be."""
        with self._lock:
            if str(request_id) in self._streams:
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
                outputs = self.engine.step()
                with self._lock:
                    self._stats = self.engine.stats()
                    self._deliver(outputs)
        except BaseException as e:  # anything at all: every waiter must hear of it
            self.error = e
            self._fail_all(e)

    def _wait_for_work(self) -> bool:
        """Apply queued commands and block until there is a step to run (False: shut down). With
        max_wait_ms, an idle engine waits for a short queue to fill a batch, up to the deadline."""
        with self._lock:
            while not self._stopping:
                if self._commands:
                    self._apply_commands()
                    self._stats = self.engine.stats()
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
            if kind == "add":  # checked in the caller's thread, and its id is unique here: no second look
                self.engine.submit(arg)
            else:
                final = self.engine.abort(arg)
                self._deliver([final] if final else [])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Send each output to its stream (under the lock); stop requests nobody reads any more."""
        for request_id in self._streams.deliver(outputs):
            self._commands.append(("abort", request_id))

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            targets = self._streams.close_all()
        for target in targets:
            send(target, error)
