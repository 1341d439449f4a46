"""The draft-model proposer: a smaller model of the same vocabulary (say the pipeline's own layer-pruned and
quantized copy of the target) runs K greedy steps per verify step, on a runner and KV cache of its own.

Per sequence it keeps the tokens whose K/V its cache holds. Before proposing it catches up with what the
target appended since (the prompt, the first time; later the accepted drafts' tail and the bonus token),
in the same step as its first draft, then runs one single-token step per further draft. Drafts the target
rejected are dropped from its cache the same way the target drops them: their positions are rewritten.
"""
from __future__ import annotations

from .block_manager import BlockManager
from .inputs import StepBuilder
from .sequence import Sequence

MAX_ROWS_CATCH_UP = 8  # a catch-up this short runs as single-token rows (the decode path); longer ones as a prefill


class DraftSeq:
    """A sequence's state in the draft's cache (duck-typed for BlockManager: block_table, num_tokens)."""

    def __init__(self, seq: Sequence):
        self.seq = seq
        self.tokens: list[int] = []  # tokens whose K/V are in the draft cache, in order
        self.own = 0  # tokens[:own] are the sequence's own (the rest are drafts, maybe rejected since)
        self.block_table: list[int] = []
        self.extra_tables: list[list[int]] = []  # the draft model's KV layer groups 1.. (block_manager.py)
        self.block_hashes: list[int] = []
        self.num_computed_tokens = self.num_cached_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def sync(self) -> None:
        """Keep only the cached tokens the sequence still has (the drafts the target accepted), short of its
        last token, which runs again to give the first draft's logits."""
        ids, n = self.seq.token_ids, min(self.own, len(self.seq.token_ids) - 1)
        while n < len(self.tokens) and n < len(ids) - 1 and self.tokens[n] == ids[n]:
            n += 1
        del self.tokens[n:]
        self.own = n


class DraftProposer:
    """`Proposer` by a draft model: `runner` runs it (a ModelRunner, its own cache), greedy."""

    def __init__(self, runner):
        self.runner = runner
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False,
                                   windows=runner.kv_windows)
        self.states: dict[str, DraftSeq] = {}  # by request id

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        self._drop_finished()
        drafts: list[list[int]] = [[] for _ in requests]
        live = [(i, self._ready(seq, k), k) for i, (seq, k) in enumerate(requests)]
        live = [(i, state, k) for i, state, k in live if state is not None]
        step = StepBuilder(self.runner.block_size)
        for _, state, _ in live:  # catch up, and the first draft
            todo = state.seq.token_ids[state.num_tokens:]
            step.add(todo, state.num_tokens, state.block_table, 1, as_rows=len(todo) <= MAX_ROWS_CATCH_UP,
                     extra_tables=state.extra_tables)
            state.tokens += todo
            state.own = state.num_tokens
        for depth in range(max((k for _, _, k in live), default=0)):
            if depth:
                step = StepBuilder(self.runner.block_size)
                for i, state, _ in live:
                    step.add([drafts[i][-1]], state.num_tokens, state.block_table, 1, extra_tables=state.extra_tables)
                    state.tokens.append(drafts[i][-1])
            for (i, _, _), token in zip(live, self.runner.execute(step.build()).argmax(dim=-1).tolist()):
                drafts[i].append(token)
            live = [(i, state, k) for i, state, k in live if k > depth + 1]
        return drafts

    def _ready(self, seq: Sequence, k: int) -> DraftSeq | None:
        """`seq`'s state, synced, with cache slots for its k - 1 drafts past its tokens; None where the
        draft's cache or positions have no room (it then decodes plainly this step)."""
        state = self.states.get(seq.request_id)
        if state is None:
            state = self.states[seq.request_id] = DraftSeq(seq)
        state.sync()
        last = seq.num_tokens + k - 1  # positions the draft writes: its catch-up and k - 1 drafts
        if last > self.runner.max_model_len:
            return None
        extra = last - state.num_tokens
        if self.blocks.reserve(state, extra) < extra:
            self.blocks.trim(state)
            return None
        return state

    def release(self, seq: Sequence) -> None:
        """Free a finished sequence's draft cache."""
        state = self.states.pop(seq.request_id, None)
        if state is not None:
            self.blocks.free(state)

    def _drop_finished(self) -> None:
        for state in [s for s in self.states.values() if s.seq.is_finished]:  # ended without `release`
            self.release(state.seq)
