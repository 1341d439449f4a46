"""One request at a time through `model.generate`, each new token handed to the event loop as it is made."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .hf import sampling_kwargs


class QueueStreamer(BaseStreamer):
    """Hands each generated token id to the event loop; the first put() is the prompt and is skipped."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue, self.prompt_seen = loop, queue, False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, token)

    def end(self, error: Exception | None = None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, error)


class Cancelled(StoppingCriteria):
    """Stops a generation whose client went away."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


class Baseline:
    """The model, its tokenizer and a single worker thread: requests queue FIFO behind it."""

    def __init__(self, model, tokenizer, name: str):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.worker = ThreadPoolExecutor(max_workers=1)  # one request at a time, in arrival order

    def _generate(self, ids, params: dict, streamer: QueueStreamer, cancel: threading.Event) -> None:
        if cancel.is_set():
            return streamer.end()
        try:
            with torch.inference_mode():
                self.model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), streamer=streamer,
                    stopping_criteria=StoppingCriteriaList([Cancelled(cancel)]),
                    pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                    **sampling_kwargs(params["max_tokens"], params["ignore_eos"], params["temperature"],
                                      params["top_p"]))
        except Exception as e:  # reported to the client as an error event, the server keeps serving
            return streamer.end(e)
        streamer.end()

    async def tokens(self, ids, params: dict):
        """Yields generated token ids as they are made."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        loop.run_in_executor(self.worker, self._generate, ids.to(self.model.device), params,
                             QueueStreamer(loop, queue), cancel)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            cancel.set()  # the client left (or we are done): free the worker at its next step

    async def texts(self, ids, params: dict):
        """Yields (text delta, tokens so far) per token; a partial UTF-8 character waits for the next."""
        generated, sent = [], ""
        async for token in self.tokens(ids, params):
            generated.append(token)
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            delta = "" if text.endswith("\ufffd") else text[len(sent):]
            sent += delta
            yield delta, len(generated)
