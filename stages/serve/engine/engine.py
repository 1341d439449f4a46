"""LLMEngine: requests in, streamed outputs out; one `step()` = schedule -> run -> sample -> postprocess.

A request is checked once, when it is made (`make_request`); `submit` queues it without a second
look. The scheduler owns the request from then on and decides, token by token, when it ends.

The engine is synchronous and single-threaded; `AsyncEngine` (async_engine.py) drives it from a
thread of its own for asyncio servers. The runner is anything with `execute(StepInput) -> logits`
and `num_blocks`, `block_size`, `max_model_len` (see `stages/serve/runner.py`).
"""
from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field, replace

from .config import EngineConfig, SamplingParams, SpeculativeConfig
from .detokenizer import OutputText
from .inputs import build_step_input
from .request import Request, RequestChecker, prompt_ids
from .sampling import Sampler, SamplerOutput, TokenLogprobs
from .scheduler import Scheduler
from .speculative import SpecStats, Speculator
from .sequence import Sequence


@dataclass
class RequestOutput:
    """What one step did for one request (the last one has `finished` set)."""
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


ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's


@dataclass
class IterationTokens:
    """Tokens per engine step (prefill chunks + decodes + drafts) as histogram counts: vLLM's
    iteration_tokens_total. `counts[i]` steps had at most `ITERATION_TOKEN_BUCKETS[i]` tokens (the last: more)."""
    counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
    sum: int = 0

    def observe(self, num_tokens: int) -> None:
        self.counts[bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        self.sum += num_tokens

    def copy(self) -> IterationTokens:
        return IterationTokens(list(self.counts), self.sum)


@dataclass
class EngineStats:
    """The engine's counts at one moment (the metrics and the server's admission read them)."""
    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    kv_cache_usage: float  # fraction of blocks held by sequences
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which served from the cache
    num_preemptions: int
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    num_queued_prompt_tokens: int = 0  # prompt tokens of unfinished requests without an output token yet
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding's counts (zero without it)
    iteration_tokens: IterationTokens = field(default_factory=IterationTokens)


class LLMEngine:
    """Owns the scheduler (and through it every unfinished request), the runner and the sampler."""

    def __init__(self, runner, tokenizer, config: EngineConfig, eos_token_ids=None, proposer=None):
        """proposer: the drafts' source when `config.speculative` is set (n-gram lookup is made here; a draft
        model's `DraftProposer` comes from whoever loaded the model, see stages/serve/build.py)."""
        if runner.block_size != config.block_size:
            raise ValueError(f"runner block size {runner.block_size} != engine block size {config.block_size}")
        windows = tuple(getattr(runner, "kv_windows", (None,)))
        self.config = config.resolved(runner.num_blocks, runner.max_model_len, len(windows))
        self.runner, self.tokenizer = runner, tokenizer
        self.scheduler = Scheduler(self.config, windows)
        self.sampler = Sampler(self.config.seed)
        eos = [tokenizer.eos_token_id] if eos_token_ids is None else list(eos_token_ids)
        self.eos_token_ids = frozenset(t for t in eos if t is not None)
        self.checker = RequestChecker(self.config, _vocab_size(runner), windows)
        self.thread_governor = None  # CPU: set by the command (llmopt.kernels.threads.governor_for), ticked per step
        self.speculator = _speculator(self.config.speculative, proposer, getattr(runner, "max_fused_rows", None))
        self.iteration_tokens = IterationTokens()
        self.slowdown = step_slowdown()  # 1.0 unless the CI gate's test hook is set
        self.pipeline_depth = getattr(runner, "pipeline_depth", 1)  # micro-batches a pipeline keeps in flight
        if self.pipeline_depth > 1 and self.speculator is not None:
            raise ValueError("speculative decoding does not run on a pipeline-parallel model yet")
        self._in_flight: deque = deque()  # ScheduledBatches submitted and not yet collected, oldest first
        self._busy: set[int] = set()  # id() of their sequences
        prebuild = getattr(runner, "prebuild_matmuls", None)  # CPU: every matmul shape a step can produce
        if prebuild is not None:
            prebuild(self.config.max_num_batched_tokens, self.config.seqs_per_step)

    # --- requests -------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: str | None = None, params: SamplingParams | None = None,
                     prompt_token_ids: list[int] | None = None, arrival_time: float | None = None) -> Request:
        """A checked Request (RequestRejected says why it can never run); `submit` queues it."""
        ids = prompt_ids(self.tokenizer, prompt, prompt_token_ids)
        return self.checker.request(request_id, ids, params, arrival_time)

    def submit(self, request: Request) -> None:
        """Queue a request made by `make_request` (it is not checked again)."""
        ids = list(request.prompt_token_ids)
        text = OutputText(self.tokenizer, ids, request.params)
        self.scheduler.add(Sequence(request.request_id, ids, request.params, self.eos_token_ids,
                                    request.arrival_time, text))

    def add_request(self, request_id: str, prompt: str | None = None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None) -> None:
        self.submit(self.make_request(request_id, prompt, params, prompt_token_ids, arrival_time))

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now and free its blocks; its final output, or None if it is unknown or done."""
        seq = self.scheduler.abort(str(request_id))
        if seq is not None and self.speculator is not None:
            self.speculator.release(seq)
        return None if seq is None else _output(seq, [], None)

    def has_unfinished(self) -> bool:
        """Requests to run, or micro-batches still in flight (whose requests may have been aborted meanwhile)."""
        return self.scheduler.has_unfinished() or bool(self._in_flight)

    # --- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; outputs for every request that got a new token (finished or not). A pipeline
        (`runner.pipeline_depth` > 1) instead tops up the micro-batches in flight, then finishes the oldest."""
        if self.pipeline_depth > 1:
            return self._pipelined_step()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        if self.thread_governor is not None:  # here: torch's thread count is per thread, and this one runs the step
            self.thread_governor.tick()
        if self.speculator is not None:
            self.speculator.propose(batch, self.scheduler)
        self.iteration_tokens.observe(batch.num_tokens)
        start = time.perf_counter() if self.slowdown > 1 else 0.0
        outputs = self._finish(batch, self.runner.execute(build_step_input(batch, self.config.block_size)))
        if self.slowdown > 1:  # the test hook: the step takes `slowdown` times as long
            time.sleep((self.slowdown - 1) * (time.perf_counter() - start))
        return outputs

    def _pipelined_step(self) -> list[RequestOutput]:
        """vLLM's virtual engines with one scheduler: while fewer than `pipeline_depth` micro-batches are in
        flight, schedule one of the sequences not in flight (each batch at most its share of --max-num-seqs)
        and submit it; then wait for the oldest one's logits and finish it as `step` does."""
        depth = self.pipeline_depth
        share = -(-self.config.seqs_per_step // depth)
        while len(self._in_flight) < depth:
            batch = self.scheduler.schedule(frozenset(self._busy), share)
            if not batch:
                break
            if self.thread_governor is not None:
                self.thread_governor.tick()
            self.iteration_tokens.observe(batch.num_tokens)
            self.runner.submit(build_step_input(batch, self.config.block_size))
            self._in_flight.append(batch)
            self._busy.update(id(seq) for seq in batch.seqs)
        if not self._in_flight:
            return []
        batch = self._in_flight.popleft()
        logits = self.runner.collect()
        self._busy.difference_update(id(seq) for seq in batch.seqs)
        return self._finish(batch, logits)

    def _finish(self, batch, logits) -> list[RequestOutput]:
        """Sample a run batch's logits and account for it: outputs for its sequences that got tokens."""
        rows = batch.sampled_seqs  # a verify step's sequence has a row per draft, plus one
        sampled = self.sampler(logits, rows) if rows else SamplerOutput([], [])
        appended = self.scheduler.postprocess(batch, sampled.token_ids)
        firsts = [i for i, seq in enumerate(rows) if i == 0 or rows[i - 1] is not seq]
        if self.speculator is not None:
            for i in firsts:
                if rows[i].is_finished:
                    self.speculator.release(rows[i])
        return [_output(rows[i], tokens, [sampled.logprobs[i]] if sampled.logprobs[i] else None)
                for i, tokens in zip(firsts, appended) if tokens]  # none: aborted while in flight

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.scheduler.block_manager
        return EngineStats(num_running=len(s.running), num_waiting=len(s.waiting), num_blocks=bm.num_blocks,
                           num_free_blocks=bm.num_free_blocks, kv_cache_usage=bm.usage,
                           prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
                           num_preemptions=s.num_preemptions, finished=dict(s.finished_by_reason),
                           num_queued_prompt_tokens=s.num_queued_prompt_tokens, spec=replace(s.spec_stats),
                           iteration_tokens=self.iteration_tokens.copy())

    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run every prompt (text or token ids) to its end. One output per prompt, in order: the
        final one, with `token_ids` and `logprobs` holding all the request's output."""
        requests = [self.make_request(f"generate-{i}", *((p, params) if isinstance(p, str) else (None, params, p)))
                    for i, p in enumerate(prompts)]  # every prompt is checked before any runs
        for request in requests:
            self.submit(request)
        tokens = {r.request_id: [] for r in requests}
        logprobs = {r.request_id: [] for r in requests}
        final = {}
        while self.has_unfinished():
            for out in self.step():
                tokens[out.request_id] += out.token_ids
                logprobs[out.request_id] += out.logprobs or []
                if out.finished:
                    final[out.request_id] = out
        return [replace(final[r.request_id], token_ids=tokens[r.request_id],
                        logprobs=logprobs[r.request_id] if r.params.logprobs is not None else None) for r in requests]


def _output(seq: Sequence, tokens: list[int], logprobs) -> RequestOutput:
    """`seq`'s output for this step: its new tokens and the text released since its last output."""
    text = seq.output_text
    return RequestOutput(
        request_id=seq.request_id, token_ids=tokens, delta_text=text.take_delta(), text=text.text,
        finished=seq.is_finished, finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens, logprobs=logprobs, arrival_time=seq.arrival_time,
        first_token_time=seq.first_token_time, finish_time=seq.finish_time,
        first_scheduled_time=seq.first_scheduled_time)


SLOWDOWN_ENV = "LLMOPT_TEST_SLOW_STEP"


def step_slowdown() -> float:
    """The test hook that `make bench-ci`'s own check uses (docs/ci.md): LLMOPT_TEST_SLOW_STEP=2 makes every engine
    step sleep as long again as it ran, a deliberate 2x slowdown for the performance gate to catch. Unset (as it
    ships), 1.0: the step is not timed at all."""
    raw = os.environ.get(SLOWDOWN_ENV, "").strip()
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 1.0 <= value <= 100.0:
        raise ValueError(f"{SLOWDOWN_ENV}={raw!r}: give the factor a step is slowed by, from 1 to 100 (a test hook)")
    return value


def _speculator(config: SpeculativeConfig | None, proposer, max_rows: int | None) -> Speculator | None:
    if config is None:
        return None
    if proposer is None and config.method == "ngram":
        from .ngram import NgramProposer

        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if proposer is None:
        raise ValueError(f"--speculative {config.method} needs its proposer (build_engine loads the draft model)")
    return Speculator(config, proposer, max_rows)


def _vocab_size(runner) -> int | None:
    size = getattr(runner, "vocab_size", None)
    if size is None:
        spec = getattr(getattr(runner, "runtime", None), "spec", None)
        size = getattr(spec, "vocab_size", None)
    return size
