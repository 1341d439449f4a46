"""Per-step attention of the CPU backends: RoPE, KV-cache writes and paged attention.

The backend builds one of these per step from its `StepMetadata`; every layer then calls `rotate` and
`attend`. Everything that depends only on the step (cos/sin rows, gather indices, masks) is computed
once here instead of once per layer. The cache of a layer is [num_blocks, block_size, 2, Hk, D]: a
token's key and value side by side, so one op writes or gathers both.

- `CpuAttention` ("cpu-torch"): decode sequences (one new token) are attended in batched SDPA calls
  over their gathered blocks, grouped by context length so that one long sequence does not pad every
  short one to its length (`decode_groups`).
- `NativeCpuAttention` ("cpu-native"): decode sequences go to the native paged-decode kernel
  (`cpu_native.paged_decode`), which reads every cached row once, in place, and RoPE to `cpu_native.rope_`;
  it also plans the fused decode step (`fused_plan`).
Prefill chunks go one sequence at a time (a few per step), a fresh prompt straight from its own k/v
without a cache round trip.

With a sliding `window` (a query at p sees keys p - window < k <= p) every path gathers or reads only the
rows inside some query's window: older blocks may have been freed and hold other data (NaN too), and a
masked NaN value still poisons SDPA's output. The fused decode step passes the window to the same native
paged decode (`fused_plan`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_native
from .paged_attention import StepMetadata, check_window, visible_keys, window_start

# A batched decode call's fixed cost in keys: gather + SDPA + scatter of a group took ~60 us more than its
# keys here, at ~0.15 us per key (fp32 and bf16, 30-layer SmolLM2 shapes).
GROUP_OVERHEAD_KEYS = 384


@dataclass(frozen=True)
class DecodeGroup:
    """Sequences with one new token and similar context lengths: attended in one batched SDPA call."""

    rows: slice | torch.Tensor  # their rows of the flat batch
    gather: torch.Tensor  # [Bd * L] cache slots of the L keys each sees (padding: slot of its first key)
    mask: torch.Tensor | None  # [Bd, 1, 1, L] True where a key exists; None when all are L long


@dataclass(frozen=True)
class NativeDecode:
    """Every decode sequence of the step, for one call of the native kernel."""

    rows: slice | torch.Tensor  # their rows of the flat batch
    block_tables: torch.Tensor  # [Bd, max_blocks] int32, contiguous
    context_lens: torch.Tensor  # [Bd] int32


@dataclass(frozen=True)
class FusedPlan:
    """A decode step's attention as the fused decode step takes it (one KV layer group's)."""

    cos_sin: torch.Tensor  # [M, head_dim] RoPE rows
    slots: torch.Tensor  # [M] int64 cache slots
    block_tables: torch.Tensor  # [M, max_blocks] int32
    context_lens: torch.Tensor  # [M] int32
    scale: float
    block_size: int
    window: int | None


@dataclass(frozen=True)
class Prefill:
    """One sequence bringing several new tokens."""

    rows: slice
    gather: torch.Tensor | None  # [C] cache slots of the C keys its queries see; None: no cached prefix, use k/v
    mask: torch.Tensor | None  # [L, C] causal (and window) mask shifted by the prefix; None: plain causal


def _slots(block_tables: torch.Tensor, length: int, block_size: int, start: torch.Tensor | None = None) -> torch.Tensor:
    """[S, length] cache slot of positions start..start+length-1 of each sequence's block table (start [S]:
    the first position of each; None: 0)."""
    pos = torch.arange(length, device=block_tables.device)
    if start is None:
        blocks = block_tables[:, pos // block_size].long()  # [S, length]
        return blocks * block_size + pos % block_size
    pos = start.long()[:, None] + pos  # [S, length]
    return block_tables.long().gather(1, pos // block_size) * block_size + pos % block_size


def decode_groups(lens: list[int], overhead: int) -> list[list[int]]:
    """Partition decode sequences (by index into `lens`, their context lengths) into groups that are
    attended together, each padded to its longest member.

    A group costs `overhead` (one call's fixed cost, in keys) plus members x its longest length.
    Walking from the longest sequence down, a new group starts where that pays off: when giving
    every remaining sequence the current one's length instead of the group's would save more keys
    than a call costs. One 800-token context among fifteen of 50 tokens: two groups, ~1,550 keys
    read instead of 12,800.
    """
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    for rank, i in enumerate(order):
        remaining = len(order) - rank
        if not groups or remaining * (lens[groups[-1][0]] - lens[i]) > overhead:
            groups.append([i])
        else:
            groups[-1].append(i)
    return groups


def _as_rows(index: list[int], device) -> slice | torch.Tensor:
    if index == list(range(index[0], index[-1] + 1)):
        return slice(index[0], index[-1] + 1)
    return torch.tensor(index, dtype=torch.long, device=device)


class CpuAttention:
    """RoPE and paged attention in plain torch, with the step's metadata precomputed.

    `group_overhead_keys`: a batched decode call's fixed cost in keys, which decides how decode
    sequences are grouped (`decode_groups`); `window`: the sliding window in keys (None: full causal).
    """

    def __init__(self, meta: StepMetadata, cos_sin_cache: torch.Tensor, scale: float, block_size: int,
                 dtype: torch.dtype, group_overhead_keys: int = GROUP_OVERHEAD_KEYS, window: int | None = None):
        check_window(window)
        self.meta, self.scale, self.block_size, self.dtype = meta, scale, block_size, dtype
        self.group_overhead_keys, self.window = group_overhead_keys, window
        self.cos_sin = cos_sin_cache.index_select(0, meta.positions).to(dtype)  # [T, D] = cos || sin
        self.cu, self.ctx = meta.cu_seqlens_q.tolist(), meta.context_lens.tolist()
        q_lens = [self.cu[i + 1] - self.cu[i] for i in range(len(self.ctx))]
        self.single = [i for i, n in enumerate(q_lens) if n == 1]  # the decode sequences
        self.prefills = [self._plan_prefill(i) for i, n in enumerate(q_lens) if n > 1]
        self._rope = self._groups = None  # planned on first use

    @property
    def groups(self) -> list[DecodeGroup]:
        """The decode groups, planned on first use (the native kernel needs none)."""
        if self._groups is None:
            lens = [self._seen(i) for i in self.single]
            parts = decode_groups(lens, self.group_overhead_keys) if self.single else []
            self._groups = [self._plan_group([self.single[j] for j in sorted(g)]) for g in parts]
        return self._groups

    def _seen(self, seq: int) -> int:
        """How many keys the decode sequence `seq` attends to: its context, or the window of it."""
        return self.ctx[seq] if self.window is None else min(self.ctx[seq], self.window)

    def _plan_group(self, seqs: list[int]) -> DecodeGroup:
        lens = [self._seen(i) for i in seqs]
        longest = max(lens)
        tables = self.meta.block_tables
        idx = torch.tensor(seqs, dtype=torch.long, device=tables.device)
        lens_t = torch.tensor(lens, dtype=torch.long, device=idx.device)
        # A window starts each sequence at its last `window` positions; then a shorter member (start 0) pads
        # past its end, and the padding below takes the slot of its first key, never a row before a window.
        start = None if self.window is None else self.meta.context_lens.index_select(0, idx).long() - lens_t
        gather = _slots(tables.index_select(0, idx), longest, self.block_size, start)  # [Bd, L]
        mask = None
        if min(lens) != longest:
            valid = torch.arange(longest, device=idx.device)[None, :] < lens_t[:, None]  # [Bd, L]
            gather = torch.where(valid, gather, gather[:, :1])
            mask = valid[:, None, None, :]
        return DecodeGroup(_as_rows([self.cu[i] for i in seqs], idx.device), gather.reshape(-1), mask)

    def _plan_prefill(self, seq: int) -> Prefill:
        start, end, ctx = self.cu[seq], self.cu[seq + 1], self.ctx[seq]
        q_len, rows = end - start, slice(start, end)
        if ctx == q_len and (self.window is None or self.window >= q_len):  # no key falls out of a window
            return Prefill(rows, None, None)
        first = window_start(ctx, q_len, self.window)  # keys before it: outside every query's window
        device = self.meta.block_tables.device
        q_pos = torch.arange(ctx - q_len, ctx, device=device)
        mask = visible_keys(q_pos, torch.arange(first, ctx, device=device), self.window)  # [L, C]
        if ctx == q_len:  # a fresh prompt longer than the window: its own k/v, masked
            return Prefill(rows, None, mask)
        tables = self.meta.block_tables[seq:seq + 1]
        gather = _slots(tables, ctx - first, self.block_size, torch.tensor([first], device=device))[0]  # [C]
        return Prefill(rows, gather, mask)

    def rotate(self, qk, q, k):
        """Rotate q and k in place; `qk` [T, (Hq + Hk) * D] is the q||k part of the fused projection."""
        if self._rope is None:  # cos [T, 1, D] and sin with the rotate-half sign folded in ([-sin, sin])
            half = self.cos_sin.shape[1] // 2
            cos, sin = self.cos_sin[:, :half], self.cos_sin[:, half:]
            self._rope = torch.cat([cos, cos], -1)[:, None], torch.cat([-sin, sin], -1)[:, None]
        cos, sin_signed = self._rope
        t, d = qk.shape[0], cos.shape[-1]
        x = qk.view(t, -1, d)  # [T, Hq + Hk, D]: q and k heads rotated together
        half = d // 2
        swapped = torch.cat([x[..., half:], x[..., :half]], -1)  # rotate_half without the sign
        torch.addcmul(x * cos, swapped, sin_signed, out=x)  # x is no input: safe to write

    def attend(self, q, k, v, kv, kv_cache):
        """Write this step's k||v rows `kv` [T, 2 * Hk * D] into the cache [blocks, block_size, 2, Hk, D],
        then attention of q [T, Hq, D] (k, v [T, Hk, D] are views of kv); returns [T, Hq, D]."""
        flat = kv_cache.view(-1, kv.shape[1])  # [slots, 2 * Hk * D]: one row per cached token
        flat.index_copy_(0, self.meta.slot_mapping, kv)
        decodes = self.decode_plans(flat)
        if len(decodes) == 1 and not self.prefills:  # every row decodes in one call
            return self.attend_decode(q, flat, decodes[0])
        out = torch.empty_like(q)
        for plan in decodes:
            out[plan.rows] = self.attend_decode(q[plan.rows], flat, plan)
        for p in self.prefills:
            out[p.rows] = self._attend_prefill(q[p.rows], k[p.rows], v[p.rows], flat, p)
        return out

    def decode_plans(self, flat: torch.Tensor) -> list:
        """How this step's decode sequences are attended over the cache rows `flat`."""
        return self.groups

    def attend_decode(self, q, flat, plan: DecodeGroup):
        """Attention of the decode rows q [Bd, Hq, D] of one plan over the cache rows `flat`."""
        bd, hq, d = q.shape
        hk = flat.shape[1] // (2 * d)
        kv = flat.index_select(0, plan.gather).view(bd, -1, 2, hk, d)  # [Bd, L, 2, Hk, D]
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [Bd, Hk, L, D]
        qg = q.reshape(bd, hk, hq // hk, d)  # [Bd, Hk, group, D]: a group's q heads share one kv head
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=plan.mask, scale=self.scale)
        return o.reshape(bd, hq, d)

    def _attend_prefill(self, q, k, v, flat, plan: Prefill):
        if plan.gather is not None:  # a cached prefix: keys are the whole sequence so far
            kv = flat.index_select(0, plan.gather).view(-1, 2, *k.shape[1:])  # [C, 2, Hk, D]
            k, v = kv[:, 0], kv[:, 1]
        # 4-D, because torch's CPU flash kernel takes only that: 3-D inputs fall back to the math
        # path, measured 2-5x slower here (5x at 800 tokens).
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=plan.mask, is_causal=plan.mask is None,
                                           scale=self.scale, enable_gqa=True)  # [1, Hq, L, D]
        return o[0].transpose(0, 1)


class NativeCpuAttention(CpuAttention):
    """CpuAttention with the native kernels: paged decode read in place and RoPE, where they take the dtype."""

    def __init__(self, meta: StepMetadata, cos_sin_cache: torch.Tensor, scale: float, block_size: int,
                 dtype: torch.dtype, group_overhead_keys: int = GROUP_OVERHEAD_KEYS, window: int | None = None):
        super().__init__(meta, cos_sin_cache, scale, block_size, dtype, group_overhead_keys, window)
        self.native_rope = cpu_native.ops_supported(dtype)
        self.native = self._plan_native() if self.single and cpu_native.supports(dtype) else None

    def _plan_native(self) -> NativeDecode:
        meta = self.meta
        if len(self.single) == len(self.ctx):  # every sequence decodes: rows 0..B-1, tables as they are
            rows, tables, lens = slice(0, len(self.ctx)), meta.block_tables, meta.context_lens
        else:
            idx = torch.tensor(self.single, dtype=torch.long, device=meta.block_tables.device)
            rows = _as_rows([self.cu[i] for i in self.single], idx.device)
            tables, lens = meta.block_tables.index_select(0, idx), meta.context_lens.index_select(0, idx)
        return NativeDecode(rows, tables.to(torch.int32).contiguous(), lens.to(torch.int32).contiguous())

    def rotate(self, qk, q, k):
        if not self.native_rope:
            return super().rotate(qk, q, k)
        cpu_native.rope_(qk, self.cos_sin, self.cos_sin.shape[1])

    def decode_plans(self, flat):
        if self.native is not None and flat.dtype == self.dtype:
            return [self.native]
        return super().decode_plans(flat)

    def attend_decode(self, q, flat, plan):
        if not isinstance(plan, NativeDecode):
            return super().attend_decode(q, flat, plan)
        return cpu_native.paged_decode(q, flat, plan.block_tables, plan.context_lens, self.scale, self.block_size,
                                       window=self.window)

    def fused_plan(self, rows: int, max_rows: int, cache_dtype: torch.dtype) -> "FusedPlan | None":
        """What the fused decode step (`cpu_native.DecodeLayers.run`) needs of this step's attention, when the
        step is one native decode token per sequence for at most `max_rows` sequences, RoPE and cache native
        too; else None (the per-layer path runs)."""
        plan = self.native
        if plan is None or self.prefills or not self.native_rope or rows > max_rows \
                or plan.rows != slice(0, rows) or cache_dtype != self.cos_sin.dtype:
            return None
        return FusedPlan(self.cos_sin, self.meta.slot_mapping, plan.block_tables, plan.context_lens, self.scale,
                         self.block_size, self.window)
