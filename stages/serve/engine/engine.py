"""LLMEngine: requests in, streamed outputs out; one `step()` = schedule -> run -> sample -> postprocess.

The engine is synchronous and single-threaded; `AsyncEngine` (async_engine.py) drives it from a
thread of its own for asyncio servers. The runner is anything with `execute(StepInput) -> logits`
and `num_blocks`, `block_size`, `max_model_len` (see `stages/serve/runner.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .config import EngineConfig, RequestRejected, SamplingParams
from .detokenizer import OutputText
from .inputs import build_step_input
from .sampling import Sampler, SamplerOutput, TokenLogprobs
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # new this step
    delta_text: str  # new this step
    text: str  # all the output text so far
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprobs] | None  # for the new tokens, when the request asked for them
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    first_scheduled_time: float | None = None  # when it first joined the running batch (queue time)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    kv_cache_usage: float  # fraction of blocks held by sequences
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which served from the cache
    num_preemptions: int
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests


class _Request:
    __slots__ = ("seq", "text")

    def __init__(self, seq: Sequence, text: OutputText):
        self.seq, self.text = seq, text


class LLMEngine:
    def __init__(self, runner, tokenizer, config: EngineConfig, eos_token_ids=None):
        if runner.block_size != config.block_size:
            raise ValueError(f"runner block size {runner.block_size} != engine block size {config.block_size}")
        self.config = config.resolved(runner.num_blocks, runner.max_model_len)
        self.runner, self.tokenizer = runner, tokenizer
        self.scheduler = Scheduler(self.config)
        self.sampler = Sampler(self.config.seed)
        eos = [tokenizer.eos_token_id] if eos_token_ids is None else list(eos_token_ids)
        self.eos_token_ids = frozenset(t for t in eos if t is not None)
        self.vocab_size = _vocab_size(runner, tokenizer)
        self._requests: dict[str, _Request] = {}
        prebuild = getattr(runner, "prebuild_matmuls", None)  # CPU: every matmul shape a step can produce
        if prebuild is not None:
            prebuild(self.config.max_num_batched_tokens, self.config.seqs_per_step)

    # --- requests -------------------------------------------------------------------------
    def make_sequence(self, request_id: str, prompt: str | None = None, params: SamplingParams | None = None,
                      prompt_token_ids: list[int] | None = None, arrival_time: float | None = None) -> Sequence:
        """A checked Sequence for a request (RequestRejected says why it can never run)."""
        if (prompt is None) == (prompt_token_ids is None):
            raise RequestRejected("give either a prompt or prompt_token_ids")
        ids = self.tokenizer.encode(prompt) if prompt is not None else [int(t) for t in prompt_token_ids]
        if self.vocab_size and any(not 0 <= t < self.vocab_size for t in ids):
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})")
        seq = Sequence(str(request_id), ids, params or SamplingParams(), self.eos_token_ids, arrival_time)
        self.scheduler.check(seq)
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        if seq.request_id in self._requests:
            raise RequestRejected(f"request id {seq.request_id!r} is already in use; give each request its own id")
        self.scheduler.add(seq)
        self._requests[seq.request_id] = _Request(seq, OutputText(self.tokenizer, seq.prompt_token_ids, seq.params))

    def add_request(self, request_id: str, prompt: str | None = None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None) -> None:
        self.add_sequence(self.make_sequence(request_id, prompt, params, prompt_token_ids, arrival_time))

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now and free its blocks; its final output, or None if it is unknown or done."""
        request = self._requests.pop(str(request_id), None)
        if request is None:
            return None
        self.scheduler.finish(request.seq, "abort")
        return self._output(request, [], "", None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; outputs for every request that got a new token (or was finished)."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        logits = self.runner.execute(build_step_input(batch, self.config.block_size))
        return self._postprocess(batch, self._sample(logits, batch))

    def _sample(self, logits, batch: ScheduledBatch) -> SamplerOutput:
        seqs = batch.sampled_seqs
        return self.sampler(logits, seqs) if seqs else SamplerOutput([], [])

    def _postprocess(self, batch: ScheduledBatch, sampled: SamplerOutput) -> list[RequestOutput]:
        seqs = batch.sampled_seqs
        self.scheduler.postprocess(batch, sampled.token_ids)
        return [self._advance(self._requests[seq.request_id], token, lp)
                for seq, token, lp in zip(seqs, sampled.token_ids, sampled.logprobs)]

    def _advance(self, request: _Request, token: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        seq, text = request.seq, request.text
        ended_on_token = seq.is_finished and seq.finish_reason == "stop"
        delta = "" if ended_on_token else text.add(token)  # the EOS / stop token is not part of the text
        if text.stopped:
            self.scheduler.finish(seq, "stop")
        if seq.is_finished:
            delta += text.finish()
            del self._requests[seq.request_id]
        return self._output(request, [token], delta, [logprobs] if logprobs else None)

    def _output(self, request: _Request, tokens: list[int], delta: str, logprobs) -> RequestOutput:
        seq = request.seq
        return RequestOutput(
            request_id=seq.request_id, token_ids=tokens, delta_text=delta, text=request.text.text,
            finished=seq.is_finished, finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens, logprobs=logprobs, arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time, finish_time=seq.finish_time,
            first_scheduled_time=seq.first_scheduled_time)

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.scheduler.block_manager
        return EngineStats(num_running=len(s.running), num_waiting=len(s.waiting), num_blocks=bm.num_blocks,
                           num_free_blocks=bm.num_free_blocks, kv_cache_usage=bm.usage,
                           prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
                           num_preemptions=s.num_preemptions, finished=dict(s.finished_by_reason))

    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run every prompt (text or token ids) to its end. One output per prompt, in order: the
        final one, with `token_ids` and `logprobs` holding all the request's output."""
        seqs = [self.make_sequence(f"generate-{i}", *((p, params) if isinstance(p, str) else (None, params, p)))
                for i, p in enumerate(prompts)]  # every prompt is checked before any runs
        for seq in seqs:
            self.add_sequence(seq)
        tokens = {s.request_id: [] for s in seqs}
        logprobs = {s.request_id: [] for s in seqs}
        final = {}
        while self.has_unfinished():
            for out in self.step():
                tokens[out.request_id] += out.token_ids
                logprobs[out.request_id] += out.logprobs or []
                if out.finished:
                    final[out.request_id] = out
        return [replace(final[s.request_id], token_ids=tokens[s.request_id],
                        logprobs=logprobs[s.request_id] if s.params.logprobs is not None else None) for s in seqs]


def _vocab_size(runner, tokenizer) -> int | None:
    size = getattr(runner, "vocab_size", None)
    if size is None:
        spec = getattr(getattr(runner, "runtime", None), "spec", None)
        size = getattr(spec, "vocab_size", None)
    return size
