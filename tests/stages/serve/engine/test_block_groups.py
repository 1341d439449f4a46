"""KV layer groups in the block manager: one table per group over one pool; a windowed group gives its blocks
back as they leave the window (stages/families.py: KVGroups). Pure bookkeeping, no model."""
from llmopt.stages.families import LayerAttention, Rope, kv_groups
from llmopt.stages.serve.engine.block_manager import RELEASED, BlockManager, pages_needed
from llmopt.stages.serve.engine.config import SamplingParams
from llmopt.stages.serve.engine.sequence import Sequence


def seq(n: int) -> Sequence:
    return Sequence("r", list(range(1, n + 1)), SamplingParams())


def test_groups_of_gemma3_layers_share_equal_pages():
    local, glob = LayerAttention(512, Rope(1e4)), LayerAttention(None, Rope(1e6))
    layers = tuple(glob if i % 6 == 5 else local for i in range(18))  # Gemma 3 270M: 15 local, 3 global
    g = kv_groups(layers)
    assert g.size == 3 and g.count == 6 and g.windows == (512,) * 5 + (None,)
    for group in range(6):  # every group: 3 layers of one kind, slots 0, 1, 2
        members = [i for i in range(18) if g.groups[i] == group]
        assert len(members) == 3 and sorted(g.slots[i] for i in members) == [0, 1, 2]
        assert len({layers[i] for i in members}) == 1
    one = kv_groups((glob,) * 30)  # a Llama: one group, slot i is layer i (the cache as [layers, blocks, ...])
    assert one.count == 1 and one.slots == tuple(range(30))


def test_a_windowed_group_holds_a_window_of_blocks_while_the_full_group_grows():
    bm = BlockManager(200, 4, enable_prefix_caching=True, windows=(8, None))
    assert not bm.enable_prefix_caching  # a windowed group cannot serve a cached prefix's every layer
    s = seq(10)
    bm.allocate(s)
    assert bm.held_blocks(s, 0) == bm.held_blocks(s, 1) == 3 and bm.num_free_blocks == 194
    s.num_computed_tokens = 10
    bm.commit(s)  # the next token (position 10) sees positions 3..10: block 0 (0..3) still needed
    assert s.block_table[0] != RELEASED
    for _ in range(90):  # decode: append a token, run it
        s.token_ids.append(7)
        assert bm.can_append(s)
        bm.append_slots(s)
        s.num_computed_tokens += 1
        bm.commit(s)
        assert bm.held_blocks(s, 0) <= 8 // 4 + 2  # bounded by the window
        dead = (s.num_computed_tokens - 8 + 1) // 4
        assert all(b == RELEASED for b in s.block_table[:dead]) and RELEASED not in s.block_table[dead:]
    assert bm.held_blocks(s, 1) == bm.blocks_for(100) == 25  # the full group keeps everything
    assert bm.num_free_blocks == 200 - 25 - bm.held_blocks(s, 0)
    bm.free(s)
    assert bm.num_free_blocks == 200 and s.extra_tables == []


def test_allocation_counts_every_group_and_reserve_trim_cover_them():
    bm = BlockManager(7, 4, windows=(8, None))
    big, small = seq(15), seq(10)
    assert not bm.can_allocate(big)  # 4 blocks in each of 2 groups > 7
    assert bm.can_allocate(small)
    bm.allocate(small)
    assert bm.num_free_blocks == 1
    small.num_computed_tokens = 10
    # 3 blocks a group hold 12 tokens; a 4th would be needed by both groups and one is free: 2 slots only
    assert bm.reserve(small, 8) == 2 and bm.num_free_blocks == 1
    bm.free(small)
    bm.allocate(small)
    assert bm.reserve(small, 0) == 0
    bm2 = BlockManager(8, 4, windows=(8, None))
    s = seq(10)
    bm2.allocate(s)
    assert bm2.reserve(s, 8) == 6  # one more block in each group: 16 tokens
    assert len(s.block_table) == len(s.extra_tables[0]) == 4 and bm2.num_free_blocks == 0
    bm2.trim(s)  # the drafts were rejected: both groups give the block back
    assert len(s.block_table) == len(s.extra_tables[0]) == 3 and bm2.num_free_blocks == 2


def test_pages_needed_bounds_a_window_group_by_its_window_but_not_the_prompt():
    assert pages_needed((None,), 16, 100, 1000) == 63  # one full group: the longest sequence
    # Gemma-like: 5 windowed groups of window 64 and 1 full; a short prompt generating long
    assert pages_needed((64,) * 5 + (None,), 16, 10, 1000) == 63 + 5 * (4 + 2)
    # ... a long prompt holds every group's blocks for all of it at admission
    assert pages_needed((64,) * 5 + (None,), 16, 1000, 1000) == 6 * 63
