"""Paged KV-cache bookkeeping: fixed-size blocks, block tables, reference counts, prefix caching.

A full block whose K/V are computed is identified by the hash of its tokens chained with the
previous block's hash, so equal hashes mean equal prefixes. A later sequence with the same prefix
shares those blocks (reference count + 1) and skips their prefill. A block whose count drops to 0
keeps its hash and contents in a free-but-cached LRU list: it can be hit again until a fresh
block is needed and it is evicted (plain free blocks are used first, then the least recently freed).
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


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
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

    def can_allocate(self, seq: Sequence) -> bool:
        hits, _ = self._match_prefix(seq)
        reclaimed = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # hits that leave the free list
        return self.blocks_for(seq.num_tokens) - len(hits) + reclaimed <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all of `seq`'s tokens; a cached prefix counts as computed."""
        hits, hashes = self._match_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._cached_free[block_id]
            block.ref_count += 1
        seq.block_table = hits + [self._take_free() for _ in range(self.blocks_for(seq.num_tokens) - len(hits))]
        seq.block_hashes = hashes
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_cached_tokens

    def can_append(self, seq: Sequence) -> bool:
        return self.blocks_for(seq.num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def append_slots(self, seq: Sequence) -> None:
        """Blocks for tokens appended since allocation (the decode token crossing a block edge)."""
        for _ in range(self.blocks_for(seq.num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free())

    def reserve(self, seq: Sequence, extra: int) -> int:
        """Slots for up to `extra` tokens past `seq`'s last one (a verify step's drafts), as many as free blocks
        allow; returns how many have a slot. `trim` gives back what the accepted tokens do not use."""
        have = len(seq.block_table) * self.block_size - seq.num_tokens
        extra = min(extra, have + self.num_free_blocks * self.block_size)
        for _ in range(self.blocks_for(seq.num_tokens + extra) - len(seq.block_table)):
            seq.block_table.append(self._take_free())
        return extra

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past `seq`'s tokens (reserved for drafts that were rejected). They were never full
        and computed, so they hold no prefix-cache hash."""
        while len(seq.block_table) > self.blocks_for(seq.num_tokens):
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free.append(block.block_id)

    def commit(self, seq: Sequence) -> None:
        """Publish `seq`'s newly full, computed blocks in the prefix cache (after their K/V are written)."""
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
        for block_id in reversed(seq.block_table):  # tail first, so it is evicted before the shared head
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free.append(block_id)
                else:
                    self._cached_free[block_id] = None
        seq.block_table, seq.block_hashes = [], []
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
