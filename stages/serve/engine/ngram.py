"""N-gram prompt lookup: the proposer that needs no draft model.

The last n tokens of a sequence (n from `prompt_lookup_max` down to `prompt_lookup_min`) are looked up
in everything before them, prompt and output; the tokens that followed their latest earlier occurrence
are proposed. Text that repeats or edits its input (summaries quoting it, code edits, "repeat this")
continues the way the input did, and this guesses it for the price of a dictionary lookup.

Each sequence keeps an index per n: n-gram -> the position just after its latest occurrence, extended
with the tokens appended since the last step (so a step costs O(new tokens), not O(sequence)).
"""
from __future__ import annotations

from .sequence import Sequence


class NgramIndex:
    """n-gram -> position after its latest occurrence, for every n in [low, high], over one token list."""

    __slots__ = ("low", "high", "tables", "indexed")

    def __init__(self, low: int, high: int):
        self.low, self.high = low, high
        self.tables = {n: {} for n in range(low, high + 1)}
        self.indexed = 0  # tokens[:indexed] are in the tables (as continuations)

    def extend(self, tokens: list[int]) -> None:
        """Index every n-gram of `tokens` that has a continuation (so never the current suffix)."""
        for i in range(max(self.indexed, 1), len(tokens)):
            for n, table in self.tables.items():
                if i >= n:
                    table[tuple(tokens[i - n:i])] = i
        self.indexed = max(self.indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """The up to k tokens after the latest earlier occurrence of the longest suffix found."""
        self.extend(tokens)
        end = len(tokens)
        for n in range(self.high, self.low - 1, -1):
            if end > n:
                start = self.tables[n].get(tuple(tokens[end - n:]))
                if start is not None:
                    return tokens[start:min(start + k, end)]
        return []


class NgramProposer:
    """`Proposer` by prompt lookup; its per-sequence index lives in the sequence's SpecState."""

    def __init__(self, low: int = 1, high: int = 3):
        self.low, self.high = low, high

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        drafts = []
        for seq, k in requests:
            index = seq.spec.proposer_state
            if index is None:
                index = seq.spec.proposer_state = NgramIndex(self.low, self.high)
            drafts.append(index.propose(seq.token_ids, k))
        return drafts

    def release(self, seq: Sequence) -> None:
        """Nothing to free: the index goes with the sequence."""
