"""Block manager as pure bookkeeping: allocation, prefix sharing, LRU eviction, freeing."""
from llmopt.stages.serve.engine.block_manager import BlockManager
from llmopt.stages.serve.engine.config import SamplingParams
from llmopt.stages.serve.engine.sequence import Sequence


def seq(tokens, rid="r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams())


def computed(bm: BlockManager, s: Sequence) -> None:
    """What the scheduler does once a sequence's prefill has run."""
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)


def test_allocate_append_free_counts_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10))
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    computed(bm, a)
    a.token_ids += [10, 11]  # 12 tokens: still 3 blocks
    assert bm.can_append(a)
    bm.append_slots(a)
    assert len(a.block_table) == 3
    a.token_ids.append(12)  # the 13th token opens a 4th block
    bm.append_slots(a)
    assert len(a.block_table) == 4 and len(set(a.block_table)) == 4
    bm.free(a)
    assert bm.num_free_blocks == 8 and a.block_table == [] and a.num_computed_tokens == 0


def test_can_allocate_refuses_when_full():
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    a, b = seq(range(8), "a"), seq(range(100, 108), "b")
    bm.allocate(a)
    assert not bm.can_allocate(b)
    assert bm.can_allocate(seq([1, 2, 3], "c"))


def test_identical_prefix_shares_full_blocks_and_counts_hits():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(list(range(12)) + [50], "a")  # 3 full blocks + 1 token
    bm.allocate(a)
    assert a.num_cached_tokens == 0
    computed(bm, a)
    b = seq(list(range(12)) + [60, 61], "b")
    bm.allocate(b)
    assert b.block_table[:3] == a.block_table[:3]
    assert b.block_table[3] != a.block_table[3]
    assert b.num_cached_tokens == b.num_computed_tokens == 12
    assert [bm.blocks[i].ref_count for i in a.block_table[:3]] == [2, 2, 2]
    assert bm.prefix_hits == 12 and bm.prefix_queries == 13 + 14


def test_a_different_earlier_block_breaks_the_chain():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(list(range(9)), "a")
    bm.allocate(a)
    computed(bm, a)
    b = seq([99] + list(range(1, 9)), "b")  # block 1 has equal tokens but a different prefix
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)


def test_last_token_always_runs_even_on_a_full_hit():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(range(8), "a")
    bm.allocate(a)
    computed(bm, a)
    b = seq(range(8), "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 4  # the second block holds the last token: recomputed, not shared
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_uncomputed_blocks_are_not_shared():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(range(9), "a")
    bm.allocate(a)
    a.num_computed_tokens = 4  # a chunked prefill: only the first block is written
    bm.commit(a)
    b = seq(range(9), "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 4


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5], "a")  # 3 blocks, the first two full
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    again = seq([1, 2, 3, 4, 9], "again")
    assert bm.can_allocate(again)
    bm.allocate(again)
    assert again.num_cached_tokens == 4  # a hit on free-but-cached blocks
    bm.free(again)
    other = seq([7, 7, 7, 7, 7, 7, 7], "other")  # needs all 4 blocks: every cached one is evicted
    bm.allocate(other)
    bm.free(other)
    third = seq([1, 2, 3, 4, 9], "third")
    bm.allocate(third)
    assert third.num_cached_tokens == 0


def test_eviction_takes_the_least_recently_freed_block_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = seq([1, 2, 0], "old"), seq([3, 4, 0], "new")
    for s in (old, new):
        bm.allocate(s)
        computed(bm, s)
    bm.free(old)
    bm.free(new)
    bm.allocate(seq([5], "x"))  # the two partial blocks were never cached: they go first
    bm.allocate(seq([6], "y"))
    bm.allocate(seq([7], "z"))  # evicts one cached block: old's, the least recently freed
    hit_new, hit_old = seq([3, 4, 1], "n"), seq([1, 2, 1], "o")
    assert bm._match_prefix(hit_new)[0] and not bm._match_prefix(hit_old)[0]


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a, b = seq(range(9), "a"), seq(range(9), "b")
    bm.allocate(a)
    computed(bm, a)
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and bm.prefix_hits == 0
