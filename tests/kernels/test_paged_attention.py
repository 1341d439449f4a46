"""Paged KV cache: write by slot, decode and chunked prefill vs dense causal attention."""
import math

import pytest
import torch

from llmopt.kernels import StepMetadata, paged_attention_decode, paged_attention_prefill, write_kv_cache
from tests.kernels.helpers import assert_close, requires_triton

pytestmark = requires_triton

BLOCK_SIZE, NUM_BLOCKS = 4, 48


class Batch:
    """Random sequences with their full K/V, scattered over randomly chosen cache blocks."""

    def __init__(self, ctx_lens, q_lens, hq, hk, d, device, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ctx, self.q_lens, self.hq, self.d = ctx_lens, q_lens, hq, d
        self.k = [torch.randn(c, hk, d, generator=g).to(device, dtype) for c in ctx_lens]
        self.v = [torch.randn(c, hk, d, generator=g).to(device, dtype) for c in ctx_lens]
        max_blocks = max(math.ceil(c / BLOCK_SIZE) for c in ctx_lens)
        free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
        self.block_tables = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int32)
        for s, c in enumerate(ctx_lens):
            for b in range(math.ceil(c / BLOCK_SIZE)):
                self.block_tables[s, b] = free.pop()
        self.block_tables = self.block_tables.to(device)
        self.k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, hk, d, device=device, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)

    def slots(self, s, positions):
        bt = self.block_tables[s].cpu()
        return [int(bt[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]

    def new_positions(self, s):
        return range(self.ctx[s] - self.q_lens[s], self.ctx[s])

    def fill_prefix(self, include_new=False):
        """Write everything before each sequence's new tokens (earlier chunks / shared prefix);
        with include_new, the new tokens too (decode: the current token is cached first)."""
        for s, c in enumerate(self.ctx):
            pre = c if include_new else c - self.q_lens[s]
            slots = torch.tensor(self.slots(s, range(pre)), dtype=torch.long, device=self.k_cache.device)
            write_kv_cache(self.k[s][:pre], self.v[s][:pre], self.k_cache, self.v_cache, slots, backend="torch")

    def dense_reference(self, q, scale):
        """Causal attention of each sequence's new queries over its full K/V, in fp64."""
        outs, start, group = [], 0, self.hq // self.k[0].shape[1]
        for s, c in enumerate(self.ctx):
            ql = self.q_lens[s]
            qs = q[start: start + ql].double()
            k = self.k[s].double().repeat_interleave(group, 1)
            v = self.v[s].double().repeat_interleave(group, 1)
            scores = torch.einsum("lhd,chd->hlc", qs, k) * scale
            visible = torch.arange(c)[None, :] <= torch.arange(c - ql, c)[:, None]
            scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
            outs.append(torch.einsum("hlc,chd->lhd", scores.softmax(-1), v))
            start += ql
        return torch.cat(outs)


@pytest.mark.parametrize("ctx_lens, hq, hk, d", [([1, 7, 13], 6, 2, 16), ([5, 33, 70], 4, 4, 24), ([9], 9, 3, 64)])
def test_decode_matches_dense(device_dtype, ctx_lens, hq, hk, d):
    device, dtype = device_dtype
    batch = Batch(ctx_lens, [1] * len(ctx_lens), hq, hk, d, device, dtype)
    batch.fill_prefix(include_new=True)
    q = torch.randn(len(ctx_lens), hq, d, device=device, dtype=dtype)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    scale = d ** -0.5
    expected = batch.dense_reference(q, scale)
    for backend in ("torch", "triton"):
        out = paged_attention_decode(q, batch.k_cache, batch.v_cache, batch.block_tables, ctx, scale, backend=backend)
        assert_close(out, expected, dtype)


def test_decode_ignores_padding_in_block_tables(device_dtype):
    device, dtype = device_dtype
    batch = Batch([3, 11], [1, 1], 4, 2, 16, device, dtype)
    batch.fill_prefix(include_new=True)
    batch.block_tables[0, 1:] = -1  # sequence 0 needs one block: the rest is padding
    q = torch.randn(2, 4, 16, device=device, dtype=dtype)
    ctx = torch.tensor([3, 11], dtype=torch.int32, device=device)
    expected = batch.dense_reference(q, 0.25)
    for backend in ("torch", "triton"):
        assert_close(paged_attention_decode(q, batch.k_cache, batch.v_cache, batch.block_tables, ctx, 0.25,
                                            backend=backend), expected, dtype)


@pytest.mark.parametrize("ctx_lens, q_lens", [([5, 1, 13], [5, 1, 3]), ([20, 6], [20, 2])])
def test_prefill_with_cached_prefix_matches_dense(device_dtype, ctx_lens, q_lens):
    device, dtype = device_dtype
    hq, hk, d = 6, 2, 16
    results = {}
    for backend in ("torch", "triton"):
        batch = Batch(ctx_lens, q_lens, hq, hk, d, device, dtype)
        batch.fill_prefix()
        k = torch.cat([batch.k[s][c - ql:] for s, (c, ql) in enumerate(zip(ctx_lens, q_lens))])
        v = torch.cat([batch.v[s][c - ql:] for s, (c, ql) in enumerate(zip(ctx_lens, q_lens))])
        slots = sum((batch.slots(s, batch.new_positions(s)) for s in range(len(ctx_lens))), [])
        cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
        positions = torch.cat([torch.arange(c - ql, c) for c, ql in zip(ctx_lens, q_lens)]).to(device)
        meta = StepMetadata(positions, cu.to(device), ctx, batch.block_tables,
                            torch.tensor(slots, dtype=torch.long, device=device), max(q_lens))
        q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        results[backend] = paged_attention_prefill(q, k, v, batch.k_cache, batch.v_cache, meta, d ** -0.5,
                                                   backend=backend)
        assert_close(results[backend], batch.dense_reference(q, d ** -0.5), dtype)
        full = torch.cat([batch.k_cache[batch.block_tables[s, p // BLOCK_SIZE], p % BLOCK_SIZE][None]
                          for s, c in enumerate(ctx_lens) for p in range(c)])
        assert torch.equal(full, torch.cat(batch.k))  # the new tokens landed in their slots


def test_write_kv_cache_skips_negative_slots(device_dtype):
    device, dtype = device_dtype
    k, v = torch.randn(5, 2, 8, device=device, dtype=dtype), torch.randn(5, 2, 8, device=device, dtype=dtype)
    slots = torch.tensor([3, -1, 17, 0, -1], device=device)
    caches = {}
    for backend in ("torch", "triton"):
        kc = torch.full((6, 4, 2, 8), 7.0, device=device, dtype=dtype)
        vc = kc.clone()
        write_kv_cache(k, v, kc, vc, slots, backend=backend)
        caches[backend] = (kc, vc)
    assert torch.equal(caches["torch"][0], caches["triton"][0]) and torch.equal(caches["torch"][1], caches["triton"][1])
    assert torch.equal(caches["torch"][0][4, 1], k[2]) and torch.equal(caches["torch"][1][0, 3], v[0])
    assert int((caches["torch"][0] == 7.0).all(-1).all(-1).sum()) == 6 * 4 - 3


def test_mismatched_heads_raise():
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention_decode(torch.randn(1, 5, 8), torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8),
                               torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)
