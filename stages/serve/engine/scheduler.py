"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Every step the token budget (`max_num_batched_tokens`) goes first to running decodes (one token
each), then to prefills already under way, then to waiting requests in arrival order, whose
prompts are cut into chunks that fit what is left. So a long prompt never stalls the decodes.
When a decode needs a block and none is free, the newest running sequence is preempted: its
blocks are freed and it goes back to the front of the queue, to be recomputed later.
Requests come checked (request.py); the scheduler owns every unfinished sequence until it ends.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import EngineConfig, RequestRejected
from .sequence import Sequence, SequenceStatus
from .speculative import SpecStats, accept_greedy
from .stopping import append_token


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each sequence runs this step
    samples: list[bool] = field(default_factory=list)  # whether they reach its end, so its next token is sampled
    drafts: list[list[int]] = field(default_factory=list)  # speculative tokens verified after its last one

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        self.samples.append(seq.num_computed_tokens + n == seq.num_tokens)
        self.drafts.append([])

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens) + sum(map(len, self.drafts))

    @property
    def sampled_seqs(self) -> list[Sequence]:
        """The sequence of every sampled row, in row order: a verify step's sequence once per draft, plus one."""
        return [s for s, sample, d in zip(self.seqs, self.samples, self.drafts) if sample for _ in range(len(d) + 1)]


class Scheduler:
    def __init__(self, config: EngineConfig, kv_windows: tuple[int | None, ...] = (None,)):
        """kv_windows: the window of each KV layer group (the runner's `kv_windows`; block_manager.py)."""
        if config.num_blocks is None or config.max_model_len is None:
            raise ValueError("Scheduler needs a resolved EngineConfig (num_blocks and max_model_len set)")
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                          kv_windows)
        self.requests: dict[str, Sequence] = {}  # every unfinished sequence, by request id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.num_preemptions = 0
        self.finished_by_reason: Counter[str] = Counter()
        self.spec_stats = SpecStats()
        self._busy: frozenset[int] = frozenset()
        self._max_seqs = config.seqs_per_step

    def add(self, seq: Sequence) -> None:
        """Queue a checked sequence (see RequestChecker) at the back."""
        if seq.request_id in self.requests:
            raise RequestRejected(f"request id {seq.request_id!r} is already in use; give each request its own id")
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_queued_prompt_tokens(self) -> int:
        """Prompt tokens of the unfinished sequences that have no output token yet."""
        return sum(s.num_prompt_tokens for s in self.requests.values() if not s.num_output_tokens)

    def schedule(self, busy: frozenset[int] = frozenset(), max_seqs: int | None = None) -> ScheduledBatch:
        """The next step's batch (empty when there is nothing to run).

        Pipeline parallelism (serve/pp) schedules micro-batches while earlier ones are in flight: `busy` holds
        the ids (`id(seq)`) of sequences in flight, which are neither scheduled nor preempted until their step
        is back, and `max_seqs` caps the sequences of this batch, so that the running ones share the batches."""
        batch = ScheduledBatch()
        self._busy, self._max_seqs = busy, self.config.seqs_per_step if max_seqs is None else max_seqs
        budget = self._schedule_decodes(batch, self.config.max_num_batched_tokens)
        budget = self._schedule_running_prefills(batch, budget)
        self._admit_waiting(batch, budget)
        return batch

    def _idle(self, seq: Sequence) -> bool:
        return id(seq) not in self._busy

    def _schedule_decodes(self, batch: ScheduledBatch, budget: int) -> int:
        queue = deque(s for s in self.running if s.num_uncomputed_tokens == 1 and self._idle(s))
        while queue and len(batch) < self._max_seqs:
            seq = queue.popleft()
            while not self.block_manager.can_append(seq):
                victim = next(s for s in reversed(self.running) if self._idle(s))  # seq itself at the latest
                if victim in queue:
                    queue.remove(victim)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slots(seq)
                batch.add(seq, 1)
                budget -= 1
        return budget

    def _schedule_running_prefills(self, batch: ScheduledBatch, budget: int) -> int:
        for seq in self.running:
            if budget == 0 or len(batch) >= self._max_seqs:
                break
            if seq.num_uncomputed_tokens > 1 and self._idle(seq):
                n = min(seq.num_uncomputed_tokens, budget)
                batch.add(seq, n)
                budget -= n
        return budget

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        # First come, first served: a head that does not fit blocks the queue (no starvation).
        while self.waiting and budget > 0 and len(self.running) < self.config.seqs_per_step \
                and len(batch) < self._max_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            batch.add(seq, n)
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def add_drafts(self, batch: ScheduledBatch, index: int, drafts: list[int]) -> None:
        """Verify `drafts` after the last token of the batch's sequence `index` (a decode) in this step,
        as many as free blocks have slots for."""
        seq = batch.seqs[index]
        batch.drafts[index] = drafts[:self.block_manager.reserve(seq, len(drafts))]

    def postprocess(self, batch: ScheduledBatch, sampled: list[int]) -> list[list[int]]:
        """Account for a finished step: `sampled` holds one token per row of `batch.sampled_seqs`, in that
        order. Returns the tokens appended to each sampled sequence (more than one where drafts were
        accepted). Sequences that end with a token are finished and freed; later tokens are dropped."""
        rows, appended = iter(sampled), []
        for seq, n, samples, drafts in zip(batch.seqs, batch.num_new_tokens, batch.samples, batch.drafts):
            if seq.is_finished:  # aborted while its step was in flight (pipeline parallelism): nothing to keep
                for _ in range(len(drafts) + 1 if samples else 0):
                    next(rows)
                if samples:
                    appended.append([])
                continue
            if not samples:
                seq.num_computed_tokens += n
                self.block_manager.commit(seq)
                continue
            tokens = accept_greedy(drafts, [next(rows) for _ in range(len(drafts) + 1)])
            if drafts:
                self._count_verify(seq, len(drafts), len(tokens) - 1)
            appended.append(self._append(seq, n + len(tokens) - 1, tokens))
        return appended

    def _append(self, seq: Sequence, computed: int, tokens: list[int]) -> list[int]:
        """Append `tokens` to `seq` until one ends it; `computed` tokens of this step have their K/V kept
        (its scheduled ones and the accepted drafts). The tokens appended."""
        for i, token in enumerate(tokens):
            reason = append_token(seq, token, self.config.max_model_len)
            if reason:
                self.finish(seq, reason)
                return tokens[:i + 1]
        seq.num_computed_tokens += computed
        self.block_manager.commit(seq)
        self.block_manager.trim(seq)
        return tokens

    def _count_verify(self, seq: Sequence, proposed: int, accepted: int) -> None:
        stats = self.spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += proposed
        stats.num_accepted_tokens += accepted
        seq.spec.update(proposed, accepted)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` now (a stop condition, or an abort) and free its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        del self.requests[seq.request_id]
        seq.mark_finished(reason)
        self.finished_by_reason[reason] += 1

    def abort(self, request_id: str) -> Sequence | None:
        """End a request now; its sequence, or None if it is unknown or already finished."""
        seq = self.requests.get(request_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def fill_wait_s(self, now: float | None = None) -> float:
        """How long an idle engine should wait for more requests before it starts a batch: up to
        max_wait_ms after the oldest arrival while the queue is shorter than a batch and nothing runs."""
        cfg = self.config
        if cfg.max_wait_ms <= 0 or self.running or not self.waiting or len(self.waiting) >= cfg.seqs_per_step:
            return 0.0
        now = time.time() if now is None else now
        oldest = min(s.arrival_time for s in self.waiting)
        return max(0.0, oldest + cfg.max_wait_ms / 1000.0 - now)
