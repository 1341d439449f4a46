"""Per-step attention for the runtime: RoPE, KV-cache writes and paged attention.

The runner builds one of these per step from the StepInput; every layer then calls `rotate` and
`attend`. Everything that depends only on the step (cos/sin rows, gather indices, masks) is
computed once here instead of once per layer.

- `KernelAttention` (CUDA): the kernels of `llmopt.kernels` (Triton), one launch per op.
- `CpuAttention`: decode sequences (one new token) go to the native paged-decode kernel
  (`kernels.cpu_native`, C compiled at first use), which reads every cached row once, in place,
  whatever the sequences' lengths. Where that kernel cannot run (no compiler, another dtype),
  they are attended in batched SDPA calls over their gathered blocks, grouped by context length
  so that one long sequence does not pad every short one to its length (`decode_groups`).
  Prefill chunks go one sequence at a time (a few per step), a fresh prompt straight from its
  own k/v without a cache round trip.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmopt.kernels import PrefillMetadata, apply_rotary, cpu_native, paged_attention_decode, paged_attention_prefill, \
    write_kv_cache

from .batch import StepInput


class KernelAttention:
    """The kernel launchers as they are: Triton on CUDA (on CPU tensors: Triton's interpreter, tests)."""

    def __init__(self, step: StepInput, cos_sin_cache: torch.Tensor, scale: float):
        self.step, self.cos_sin_cache, self.scale = step, cos_sin_cache, scale
        self.op_backend = None if cos_sin_cache.is_cuda else "triton"  # for the model's norm and activation
        self.meta = PrefillMetadata(step.cu_seqlens_q, step.block_tables, step.context_lens, step.slot_mapping,
                                    step.max_query_len)

    def rotate(self, qk, q, k):
        apply_rotary(q, k, self.step.positions, self.cos_sin_cache, backend=self.op_backend)

    def attend(self, q, k, v, kv, kv_cache):
        b = self.op_backend
        k_cache, v_cache = kv_cache[:, :, 0], kv_cache[:, :, 1]  # [num_blocks, block_size, Hk, D], shared strides
        if not self.step.is_decode:
            return paged_attention_prefill(q, k, v, k_cache, v_cache, self.meta, self.scale, backend=b)
        write_kv_cache(k, v, k_cache, v_cache, self.step.slot_mapping, backend=b)
        return paged_attention_decode(q, k_cache, v_cache, self.step.block_tables, self.step.context_lens,
                                      self.scale, backend=b)


@dataclass(frozen=True)
class _Decode:
    """Sequences with one new token and similar context lengths: attended in one batched call."""

    rows: slice | torch.Tensor  # their rows of the flat batch
    gather: torch.Tensor  # [Bd * L] cache slots of positions 0..L-1 of each (padding: slot of position 0)
    mask: torch.Tensor | None  # [Bd, 1, 1, L] True where a key exists; None when all are L long


@dataclass(frozen=True)
class _Native:
    """Every decode sequence of the step, for one call of the native kernel."""

    rows: slice | torch.Tensor  # their rows of the flat batch
    block_tables: torch.Tensor  # [Bd, max_blocks] int32, contiguous
    context_lens: torch.Tensor  # [Bd] int32


@dataclass(frozen=True)
class _Prefill:
    """One sequence bringing several new tokens."""

    rows: slice
    gather: torch.Tensor | None  # [C] cache slots of its C tokens; None: no cached prefix, use k/v directly
    mask: torch.Tensor | None  # [L, C] causal mask shifted by the prefix; None: plain causal


def _slots(block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """[S, length] cache slot of positions 0..length-1 of each sequence's block table."""
    pos = torch.arange(length, device=block_tables.device)
    blocks = block_tables[:, pos // block_size].long()  # [S, length]
    return blocks * block_size + pos % block_size


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
    """RoPE and paged attention in plain torch, with the step's metadata precomputed."""

    op_backend = "cpu"  # the model's norm and activation: torch fast paths
    # A batched decode call's fixed cost in keys: gather + SDPA + scatter of a group took ~60 us
    # more than its keys here, at ~0.15 us per key (fp32 and bf16, 30-layer SmolLM2 shapes).
    GROUP_OVERHEAD_KEYS = 384
    NATIVE = True  # decode through kernels.cpu_native where it runs (tests switch it off for the torch path)

    def __init__(self, step: StepInput, cos_sin_cache: torch.Tensor, scale: float, block_size: int,
                 dtype: torch.dtype):
        self.scale, self.block_size, self.slot_mapping = scale, block_size, step.slot_mapping
        self.cos_sin = cos_sin_cache.index_select(0, step.positions).to(dtype)  # [T, D] = cos || sin
        self.native_rope = self.NATIVE and cpu_native.ops_supported(dtype)
        if not self.native_rope:
            self.cos, self.sin_signed = self._rope_rows(self.cos_sin)
        cu, ctx = step.cu_seqlens_q.tolist(), step.context_lens.tolist()
        q_lens = [cu[i + 1] - cu[i] for i in range(len(ctx))]
        single = [i for i, n in enumerate(q_lens) if n == 1]
        self.native = None
        if single and self.NATIVE and cpu_native.supports(dtype):
            self.native = self._plan_native(step, single, cu, ctx)
        self._decode_plan = (step, single, cu, ctx)
        self._decodes = None
        self.prefills = [self._plan_prefill(step, i, cu[i], cu[i + 1], ctx[i]) for i, n in enumerate(q_lens) if n > 1]

    @property
    def decodes(self) -> list[_Decode]:
        """The torch path's decode groups, planned on first use (the native kernel needs none)."""
        if self._decodes is None:
            step, single, cu, ctx = self._decode_plan
            groups = decode_groups([ctx[i] for i in single], self.GROUP_OVERHEAD_KEYS) if single else []
            self._decodes = [self._plan_decode(step, [single[j] for j in sorted(g)], cu, ctx) for g in groups]
        return self._decodes

    @staticmethod
    def _plan_native(step, single: list[int], cu: list[int], ctx: list[int]) -> _Native:
        device = step.block_tables.device
        if len(single) == len(ctx):  # every sequence decodes: rows 0..B-1, tables as they are
            rows, tables, lens = slice(0, len(ctx)), step.block_tables, step.context_lens
        else:
            idx = torch.tensor(single, dtype=torch.long, device=device)
            rows = _as_rows([cu[i] for i in single], device)
            tables, lens = step.block_tables.index_select(0, idx), step.context_lens.index_select(0, idx)
        return _Native(rows, tables.to(torch.int32).contiguous(), lens.to(torch.int32).contiguous())

    @staticmethod
    def _rope_rows(cs):
        """cos [T, 1, D] and sin with the rotate-half sign folded in ([-sin, sin]) from cs [T, D] = cos || sin
        in the model's dtype (as transformers rounds them)."""
        half = cs.shape[1] // 2
        cos, sin = cs[:, :half], cs[:, half:]
        return torch.cat([cos, cos], -1)[:, None], torch.cat([-sin, sin], -1)[:, None]

    def _plan_decode(self, step, seqs: list[int], cu: list[int], ctx: list[int]) -> _Decode:
        lens = [ctx[i] for i in seqs]
        longest = max(lens)
        idx = torch.tensor(seqs, dtype=torch.long, device=step.block_tables.device)
        gather = _slots(step.block_tables.index_select(0, idx), longest, self.block_size)  # [Bd, L]
        mask = None
        if min(lens) != longest:
            lens_t = step.context_lens.index_select(0, idx)
            valid = torch.arange(longest, device=idx.device)[None, :] < lens_t[:, None]  # [Bd, L]
            gather = torch.where(valid, gather, gather[:, :1])
            mask = valid[:, None, None, :]
        return _Decode(_as_rows([cu[i] for i in seqs], idx.device), gather.reshape(-1), mask)

    def _plan_prefill(self, step, seq: int, start: int, end: int, ctx: int) -> _Prefill:
        q_len = end - start
        if ctx == q_len:
            return _Prefill(slice(start, end), None, None)
        gather = _slots(step.block_tables[seq:seq + 1], ctx, self.block_size)[0]  # [C]
        q_pos = torch.arange(ctx - q_len, ctx, device=gather.device)
        mask = torch.arange(ctx, device=gather.device)[None, :] <= q_pos[:, None]  # [L, C]
        return _Prefill(slice(start, end), gather, mask)

    def native_decode_plan(self, rows: int, max_rows: int, cache_dtype: torch.dtype):
        """(cos_sin, slots, block_tables, context_lens, scale, block_size) for the fused native decode step
        (`cpu_native.DecodeLayers.run`) when this step is one native decode token per sequence for at most
        `max_rows` sequences, rope and cache native too; else None (the per-layer path runs)."""
        plan = self.native
        if plan is None or self.prefills or not self.native_rope or rows > max_rows \
                or plan.rows != slice(0, rows) or cache_dtype != self.cos_sin.dtype:
            return None
        return (self.cos_sin, self.slot_mapping, plan.block_tables, plan.context_lens, self.scale, self.block_size)

    def rotate(self, qk, q, k):
        """Rotate q and k in place; `qk` [T, (Hq + Hk) * D] is the q||k part of the fused projection."""
        if self.native_rope:
            return cpu_native.rope_(qk, self.cos_sin, self.cos_sin.shape[1])
        t, d = qk.shape[0], self.cos.shape[-1]
        x = qk.view(t, -1, d)  # [T, Hq + Hk, D]: q and k heads rotated together
        half = d // 2
        swapped = torch.cat([x[..., half:], x[..., :half]], -1)  # rotate_half without the sign
        torch.addcmul(x * self.cos, swapped, self.sin_signed, out=x)  # x is no input: safe to write

    def attend(self, q, k, v, kv, kv_cache):
        """Write this step's k||v rows `kv` [T, 2 * Hk * D] into the cache [blocks, block_size, 2, Hk, D],
        then attention of q [T, Hq, D] (k, v [T, Hk, D] are views of kv); returns [T, Hq, D]."""
        flat = kv_cache.view(-1, kv.shape[1])  # [slots, 2 * Hk * D]: one row per cached token
        flat.index_copy_(0, self.slot_mapping, kv)
        native = self.native if self.native is not None and flat.dtype == q.dtype else None
        if native is not None and not self.prefills:
            return self._attend_native(q, flat, native)
        if native is None and len(self.decodes) == 1 and not self.prefills:
            return self._attend_decode(q, flat, self.decodes[0])
        out = torch.empty_like(q)
        if native is not None:
            out[native.rows] = self._attend_native(q[native.rows], flat, native)
        for plan in self.decodes if native is None else ():
            out[plan.rows] = self._attend_decode(q[plan.rows], flat, plan)
        for p in self.prefills:
            out[p.rows] = self._attend_prefill(q[p.rows], k[p.rows], v[p.rows], flat, p)
        return out

    def _attend_native(self, q, flat, plan: _Native):
        return cpu_native.paged_decode(q, flat, plan.block_tables, plan.context_lens, self.scale, self.block_size)

    def _attend_decode(self, q, flat, plan: _Decode):
        bd, hq, d = q.shape
        hk = flat.shape[1] // (2 * d)
        kv = flat.index_select(0, plan.gather).view(bd, -1, 2, hk, d)  # [Bd, L, 2, Hk, D]
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [Bd, Hk, L, D]
        qg = q.reshape(bd, hk, hq // hk, d)  # [Bd, Hk, group, D]: a group's q heads share one kv head
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=plan.mask, scale=self.scale)
        return o.reshape(bd, hq, d)

    def _attend_prefill(self, q, k, v, flat, plan: _Prefill):
        if plan.gather is not None:  # a cached prefix: keys are the whole sequence so far
            kv = flat.index_select(0, plan.gather).view(-1, 2, *k.shape[1:])  # [C, 2, Hk, D]
            k, v = kv[:, 0], kv[:, 1]
        # 4-D, because torch's CPU flash kernel takes only that: 3-D inputs fall back to the math
        # path, measured 2-5x slower here (5x at 800 tokens).
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=plan.mask, is_causal=plan.mask is None,
                                           scale=self.scale, enable_gqa=True)  # [1, Hq, L, D]
        return o[0].transpose(0, 1)


def attention_for(step: StepInput, cos_sin_cache: torch.Tensor, scale: float, block_size: int, dtype: torch.dtype,
                  kernels: bool | None = None):
    """The attention object for one step: kernels on CUDA, torch on CPU (`kernels` overrides)."""
    if kernels if kernels is not None else cos_sin_cache.is_cuda:
        return KernelAttention(step, cos_sin_cache, scale)
    return CpuAttention(step, cos_sin_cache, scale, block_size, dtype)
