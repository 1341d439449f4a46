"""Generation: the engine sequences of one HTTP request (each prompt times n), as one stream.

It has the engine check every sequence before any is admitted (a too-long prompt is a 400 even on
a busy server), passes its tenant's limits (or a 429, quota.py) and admission (or a 503), merges
the sequences' outputs, feeds the metrics, and on every way out — finished, client gone, timeout,
server shutdown, error — aborts what is still running, so the engine frees those KV blocks at its
next step, and gives its tenant back the tokens it did not use. The engine keeps every request's
state; this keeps only the HTTP request's: its streams, metric traces, timer and disconnect watcher.
The server's state lists it while it runs, so a drain that runs out of time can abort it.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..engine.config import ContextLengthExceeded
from ..engine.engine import RequestOutput
from ..engine.request import Request
from .errors import APIError
from .metrics import SequenceTrace
from .prompts import context_length_error


@dataclass
class ChoiceResult:
    """Everything one sequence produced, for a non-streaming response."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.delta_text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        self.finish_reason = out.finish_reason
        self.num_prompt_tokens, self.num_output_tokens = out.num_prompt_tokens, out.num_output_tokens


class Generation:
    """One HTTP request's sequences: every prompt with each of `params` (one per choice)."""

    def __init__(self, state, request_id: str, prompts: list[list[int]], params: list, prompt_param: str = "prompt",
                 protocol: str = "http"):
        self.state, self.engine = state, state.ready_engine()
        self.request_id = request_id
        self.prompt_param = prompt_param  # the body field the prompts came from, for error messages
        self.jobs = [(f"{request_id}-{len(params) * p + i}", ids, sp)
                     for p, ids in enumerate(prompts) for i, sp in enumerate(params)]
        self.traces = [SequenceTrace(state.metrics.series(protocol)) for _ in self.jobs]
        self.timed_out = self.disconnected = self.stopped = False
        self.timer = self.watcher = None
        self.access_id: str | None = None  # the access log's id of the HTTP request (X-Request-Id)
        self.streams: list[AsyncIterator[RequestOutput]] = []
        self.generated = [0] * len(self.jobs)  # output tokens per sequence so far, for the tenant's refund
        self.lease = None  # the tenant's hold (quota.py) while the request runs
        self.timeout_s: float | None = None  # when it is aborted as timed out, and which limit that is
        self.limit = "the server's --request-timeout"

    def __len__(self) -> int:
        return len(self.jobs)

    def start(self, request=None, tenant: str | None = None, timeout_s: float | None = None) -> Generation:
        """Check, admit and submit every sequence; watch `request` (an HTTP request) for a client disconnect.
        `tenant`: the key's tenant where no HTTP request tells it (gRPC); `timeout_s`: a limit of the caller's
        own (a gRPC deadline) when it is shorter than the server's --request-timeout."""
        requests = [self._checked(*job) for job in self.jobs]  # a 400 for any before anything is queued
        if request is not None:
            tenant = request.scope.get("state", {}).get("tenant")
        self.lease = self.state.quotas.acquire(tenant, self._most_tokens())
        try:
            self.state.admission.admit([len(r.prompt_token_ids) for r in requests])
            for checked in requests:
                self.streams.append(self.engine.submit(checked))
        except BaseException:  # a 503, or the engine died meanwhile: take back what was submitted
            self.close()
            raise
        self.state.in_flight.add(self)
        timeout = self.state.config.request_timeout_s
        if timeout_s is not None and (timeout is None or timeout_s < timeout):
            timeout, self.limit = timeout_s, "the call's deadline"
        self.timeout_s = timeout
        if timeout is not None:
            self.timer = asyncio.get_running_loop().call_later(timeout, self._expire)
        if request is not None:
            self.access_id = request.scope.get("state", {}).get("request_id")
            self.watcher = asyncio.ensure_future(self._watch(request))
        return self

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(sequence index, output) as they come; APIError 504 when the request timed out."""
        try:
            async for index, out in self._merged():
                self.traces[index].observe(out)
                self.generated[index] = out.num_output_tokens
                if out.finished:
                    if out.finish_reason == "abort" and self.timed_out:
                        raise APIError(504, f"the request did not finish within {self.timeout_s:g} s ({self.limit})",
                                       code="request_timeout")
                yield index, out
        finally:
            self.close()

    async def collect(self) -> list[ChoiceResult]:
        results = [ChoiceResult() for _ in self.jobs]
        async for index, out in self.outputs():
            results[index].add(out)
        if self.disconnected:  # nobody will read this; it names the outcome in the access log
            raise APIError(499, "the client closed the connection", code="client_closed_request")
        if self.stopped:
            raise APIError(503, f"the server shut down before this request finished (its --drain-timeout is "
                           f"{self.state.config.drain_timeout_s:g} s); retry on another replica", code="shutting_down",
                           headers={"Retry-After": str(self.state.config.retry_after_s), "Connection": "close"})
        return results

    def cancel(self) -> None:
        """Abort every submitted sequence (the engine leaves finished ones be and frees the rest's
        blocks at its next step)."""
        for seq_id, _, _ in self.jobs[:len(self.streams)]:
            self.engine.abort(seq_id)

    def shut_down(self) -> None:
        """Abort for a server that is stopping: a stream's last chunk says "abort", a whole response is 503."""
        self.stopped = True
        self.cancel()

    def close(self) -> None:
        """End the request for good: abort leftovers, stop the timer and watcher."""
        for handle in (self.timer, self.watcher):
            if handle is not None:
                handle.cancel()
        self.cancel()
        self.state.in_flight.discard(self)
        if self.lease is not None:
            submitted = self.jobs[:len(self.streams)]  # a request refused by admission used nothing
            self.lease.release(sum(len(ids) for _, ids, _ in submitted) + sum(self.generated))

    def _most_tokens(self) -> int:
        """Prompt + max_tokens of every sequence (to the model's length where max_tokens is not given)."""
        return sum(len(ids) + (sp.max_tokens if sp.max_tokens is not None else self.state.max_model_len - len(ids))
                   for _, ids, sp in self.jobs)

    def _checked(self, seq_id: str, ids: list[int], params) -> Request:
        try:
            return self.engine.make_request(seq_id, params=params, prompt_token_ids=ids)
        except ContextLengthExceeded:
            raise context_length_error(len(ids), params.max_tokens, self.state.max_model_len,
                                       self.prompt_param) from None

    def _expire(self) -> None:
        self.timed_out = True
        self.cancel()

    async def _watch(self, request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        self.cancel()

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self.streams) == 1:
            async for out in self.streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.ensure_future(_pump(i, stream, queue)) for i, stream in enumerate(self.streams)]
        try:
            done = 0
            while done < len(tasks):
                index, item = await queue.get()
                if item is None:
                    done += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()


async def _pump(index: int, stream: AsyncIterator[RequestOutput], queue: asyncio.Queue) -> None:
    try:
        async for out in stream:
            queue.put_nowait((index, out))
    except Exception as e:  # the engine died: the merged stream re-raises it
        queue.put_nowait((index, e))
    queue.put_nowait((index, None))
