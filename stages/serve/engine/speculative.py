"""Speculative decoding: a cheap proposer guesses a decoding sequence's next K tokens, one verify step of the
target checks them all, and the longest run the target agrees with is kept (plus the target's own next token).

- Proposers (`Proposer`): n-gram prompt lookup (`ngram.py`: the last n tokens found earlier in the prompt or
  output, their continuation proposed) and a draft model (`draft.py`: a smaller model of the same vocabulary
  runs K greedy steps on its own KV cache).
- The verify step: a sequence brings its last token plus its K drafts, and every one of the K+1 rows is
  sampled (see `inputs.build_step_input`). Row i's greedy token is what plain decoding would have produced
  after the drafts before it, so accepting drafts while they equal it, then appending the first token where
  they differ (the bonus), gives exactly the tokens of plain greedy decoding.
- Greedy only: requests that sample (temperature > 0), use penalties or ask for logprobs decode plainly.
- Backing off: each sequence adapts its K to what was accepted lately, and after verify steps that
  accepted nothing in a row it skips speculation for a growing number of steps (`SpecState`), so text the proposer
  cannot guess (free chat) costs little more than plain decoding.

The scheduler owns the acceptance (`accept_greedy`, in `Scheduler.postprocess`, where stopping is decided);
the `Speculator` here picks the sequences and asks the proposer, once the step's batch is scheduled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .config import SpeculativeConfig
from .sequence import Sequence

MAX_SKIP_STEPS = 32  # the longest pause after verify steps that accepted nothing


class Proposer(Protocol):
    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to k draft tokens for each (sequence, k), in order (fewer or none where it has no guess)."""

    def release(self, seq: Sequence) -> None:
        """Forget a finished sequence."""


class SpecState:
    """One sequence's speculation: how many drafts it asks for next, and its back-off after misses."""

    __slots__ = ("k", "max_k", "misses", "skip", "proposer_state")

    def __init__(self, max_k: int):
        self.k = self.max_k = max_k
        self.misses = 0  # verify steps in a row that accepted nothing
        self.skip = 0  # steps left without speculation
        self.proposer_state = None  # the proposer's own per-sequence data (the n-gram index)

    def wants(self) -> int:
        """Drafts to ask for this step (0: decode plainly), counting down a pause."""
        if self.skip:
            self.skip -= 1
            return 0
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        """After a verify step: all accepted grows K back, a partial run sizes it to the run, none pauses."""
        if accepted == proposed:
            self.k, self.misses = min(self.max_k, self.k + 1), 0
        elif accepted:
            self.k, self.misses = accepted + 1, 0
        else:  # one miss is cheap to retry (one draft); misses in a row pause for 1, 3, 7, ... steps
            self.k, self.misses = 1, self.misses + 1
            self.skip = min(MAX_SKIP_STEPS, 2 ** (self.misses - 1) - 1)


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens a verify step appends: the drafts while they equal the target's greedy token at their
    row, then the target's token at the first row that differs (or after the last draft)."""
    j = 0
    while j < len(drafts) and drafts[j] == targets[j]:
        j += 1
    return targets[:j + 1]


def speculates(seq: Sequence) -> bool:
    """Whether a sequence may be verified against drafts: greedy without penalties or logprobs."""
    p = seq.params
    return p.greedy and not p.has_penalties and p.logprobs is None


@dataclass
class SpecStats:
    """Counters (vLLM's spec_decode names): verify steps with drafts, drafts proposed, drafts accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step appends on average: accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    """Asks the proposer for drafts for the batch's decoding sequences and puts them into the batch.

    max_rows: the most tokens a step may have and still run on the kernels of a one-token decode step (the
    runner's fused decode step, `ModelRunner.max_fused_rows`; None: no such limit). Other kernels round
    differently, and a near tie could then flip a greedy token: no verify step leaves them."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_rows: int | None = None):
        self.config, self.proposer, self.max_rows = config, proposer, max_rows

    def propose(self, batch, scheduler) -> None:
        """Drafts for every sequence of `batch` that decodes one token and may speculate, as many as
        its SpecState asks for, the step's token budget (and row limit), its max_tokens and max_model_len allow."""
        budget = scheduler.config.max_num_batched_tokens - batch.num_tokens
        if self.max_rows is not None:
            budget = min(budget, self.max_rows - batch.num_tokens)
        wanted = []
        for i, (seq, n, samples) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.samples)):
            if n != 1 or not samples or budget <= 0 or not speculates(seq):
                continue
            if seq.spec is None:
                seq.spec = SpecState(self.config.num_speculative_tokens)
            k = min(seq.spec.wants(), budget, _room(seq, scheduler.config.max_model_len))
            if k > 0:
                wanted.append((i, seq, k))
                budget -= k
        if not wanted:
            return
        drafts = self.proposer.propose([(seq, k) for _, seq, k in wanted])
        for (i, _, _), tokens in zip(wanted, drafts):
            if tokens:
                scheduler.add_drafts(batch, i, tokens)

    def release(self, seq: Sequence) -> None:
        """A sequence ended: the proposer forgets it (a draft model frees its cache)."""
        self.proposer.release(seq)


def _room(seq: Sequence, max_model_len: int) -> int:
    """Drafts worth verifying: a verify step appends up to k + 1 tokens, and the last draft needs a position."""
    room = max_model_len - seq.num_tokens
    if seq.params.max_tokens is not None:
        room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
    return room
