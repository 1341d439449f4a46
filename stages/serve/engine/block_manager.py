"""Paged KV-cache bookkeeping: fixed-size blocks, block tables, reference counts, prefix caching.

A full block whose K/V are computed is identified by the hash of its tokens chained with the
previous block's hash, so equal hashes mean equal prefixes. A later sequence with the same prefix
shares those blocks (reference count + 1) and skips their prefill. A block whose count drops to 0
keeps its hash and contents in a free-but-cached LRU list: it can be hit again until a fresh
block is needed and it is evicted (plain free blocks are used first, then the least recently freed).

Layer groups (`stages/families.py: KVGroups`, `windows` here, one entry per group): a model whose layers
attend differently (Gemma 3's local and global layers) keeps one block table per group over the one pool
(`seq.block_table` for group 0, `seq.extra_tables` for the rest). A windowed group gives its blocks back
once every position they hold has left the window of every token still to run (`commit`), leaving
RELEASED in its table; so while a sequence generates, its windowed groups hold about window / block_size
blocks each, whatever its length. Prefix caching needs every layer's blocks of a prefix: it is off for a
model with a windowed group or several groups.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from .sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # set once the block is full and computed (and prefix caching is on)
        self.token_ids: tuple[int, ...] = ()


RELEASED = -1  # a windowed group's table entry whose block was given back (its positions left the window)


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev_hash, token_ids))


def pages_needed(windows: tuple[int | None, ...], block_size: int, prompt: int, longest: int) -> int:
    """Blocks a sequence with a `prompt`-token prompt that grows to `longest` tokens holds at its most, over
    layer groups with these windows: every group's for the whole prompt at admission, then full groups' for
    all of it and windowed groups' for their window (plus the block it starts in and one the next token opens)."""
    blocks = lambda n: -(-n // block_size)  # noqa: E731
    full = sum(w is None for w in windows) * blocks(longest)
    windowed = sum(min(blocks(longest), blocks(w) + 2) for w in windows if w is not None)
    return max(len(windows) * blocks(prompt), full + windowed)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: tuple[int | None, ...] = (None,)):
        self.block_size = block_size
        self.windows = tuple(windows)  # per layer group: its window in tokens, None for full attention
        self.enable_prefix_caching = enable_prefix_caching and self.windows == (None,)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # free, nothing cached
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # free with a hash; oldest first (LRU)
        self._by_hash: dict[int, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found there

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._cached_free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def tables(self, seq) -> list[list[int]]:
        """`seq`'s block table of every group (group 0 first)."""
        return [seq.block_table, *getattr(seq, "extra_tables", ())]

    def held_blocks(self, seq, group: int) -> int:
        """Blocks `seq` holds in `group` (a windowed group's released ones not counted)."""
        return sum(b != RELEASED for b in self.tables(seq)[group])

    def pages_needed(self, prompt: int, longest: int) -> int:
        return pages_needed(self.windows, self.block_size, prompt, longest)

    def _new_blocks(self, seq, tokens: int) -> int:
        """Blocks every group must add for `seq` to hold `tokens` positions."""
        return sum(max(0, self.blocks_for(tokens) - len(t)) for t in self.tables(seq))

    def can_allocate(self, seq: Sequence) -> bool:
        hits, _ = self._match_prefix(seq)
        reclaimed = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # hits that leave the free list
        need = len(self.windows) * self.blocks_for(seq.num_tokens) - len(hits)
        return need + reclaimed <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all of `seq`'s tokens; a cached prefix counts as computed."""
        hits, hashes = self._match_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._cached_free[block_id]
            block.ref_count += 1
        seq.block_table = hits + [self._take_free() for _ in range(self.blocks_for(seq.num_tokens) - len(hits))]
        if len(self.windows) > 1:
            seq.extra_tables = [[self._take_free() for _ in range(self.blocks_for(seq.num_tokens))]
                                for _ in self.windows[1:]]
        seq.block_hashes = hashes
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_cached_tokens

    def can_append(self, seq: Sequence) -> bool:
        return self._new_blocks(seq, seq.num_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence) -> None:
        """Blocks for tokens appended since allocation (the decode token crossing a block edge)."""
        self._grow(seq, seq.num_tokens)

    def reserve(self, seq: Sequence, extra: int) -> int:
        """Slots for up to `extra` tokens past `seq`'s last one (a verify step's drafts), as many as free blocks
        allow; returns how many have a slot. `trim` gives back what the accepted tokens do not use."""
        while extra > 0 and self._new_blocks(seq, seq.num_tokens + extra) > self.num_free_blocks:
            extra -= 1
        self._grow(seq, seq.num_tokens + extra)
        return extra

    def _grow(self, seq, tokens: int) -> None:
        for table in self.tables(seq):
            for _ in range(self.blocks_for(tokens) - len(table)):
                table.append(self._take_free())

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past `seq`'s tokens (reserved for drafts that were rejected). They were never full
        and computed, so they hold no prefix-cache hash."""
        for table in self.tables(seq):
            while len(table) > self.blocks_for(seq.num_tokens):
                self._release(table.pop())

    def _release(self, block_id: int) -> None:
        if block_id == RELEASED:
            return
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free.append(block.block_id)

    def release_out_of_window(self, seq) -> None:
        """Give back each windowed group's blocks whose positions all lie before the window of the next token
        to run (position `num_computed_tokens`: it sees positions > itself - window, and later ones see less)."""
        for table, window in zip(self.tables(seq), self.windows):
            if window is None:
                continue
            dead = max(0, seq.num_computed_tokens - window + 1) // self.block_size  # blocks wholly before it
            for i in range(min(dead, len(table))):
                if table[i] != RELEASED:
                    self._release(table[i])
                    table[i] = RELEASED

    def commit(self, seq: Sequence) -> None:
        """Publish `seq`'s newly full, computed blocks in the prefix cache (after their K/V are written), and
        give back the blocks that left a windowed group's window."""
        if any(w is not None for w in self.windows):
            self.release_out_of_window(seq)
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self._by_hash and block.hash is None:  # an equal block already cached: keep that one
                block.hash, block.token_ids = h, tokens
                self._by_hash[h] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks (its K/V are gone: nothing of it counts as computed any more)."""
        for table in self.tables(seq):
            for block_id in reversed(table):  # tail first, so it is evicted before the shared head
                if block_id == RELEASED:
                    continue
                block = self.blocks[block_id]
                block.ref_count -= 1
                if block.ref_count == 0:
                    if block.hash is None:
                        self._free.append(block_id)
                    else:
                        self._cached_free[block_id] = None
        seq.block_table, seq.block_hashes = [], []
        if len(self.windows) > 1:
            seq.extra_tables = []
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    def _match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached blocks holding `seq`'s leading full blocks, and their hashes. The last token is
        never matched: it must run to give the logits for the next one."""
        if not self.enable_prefix_caching:
            return [], []
        bs, hits, hashes = self.block_size, [], []
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(hashes[-1] if hashes else None, tokens)
            block_id = self._by_hash.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            hashes.append(h)
        return hits, hashes

    def _take_free(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._cached_free.popitem(last=False)
            block = self.blocks[block_id]
            if self._by_hash.get(block.hash) == block_id:
                del self._by_hash[block.hash]
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        return block_id
