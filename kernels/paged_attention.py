"""Attention over a paged KV cache: decode, and (chunked) prefill over a cached prefix.

Cache layout: `k_cache`, `v_cache` [num_blocks, block_size, num_kv_heads, head_dim]. Token j of
sequence s lives in block `block_tables[s, j // block_size]` at offset `j % block_size`;
`slot_mapping` addresses the same place as one integer, `block * block_size + offset`.

One kernel serves both phases. Queries are packed: rows `cu_seqlens_q[s]:cu_seqlens_q[s+1]` of
q belong to sequence s, whose cache holds `context_lens[s]` tokens *including* these new ones,
so query i sits at position `context_lens[s] - q_len + i` and attends causally to every cached
position up to its own; with a sliding `window` (transformers' `sliding_window_overlay`) only to the
`window` latest of them, p - window < k <= p. Decode is the case q_len = 1. A program owns one
(sequence, kv head, block of query rows), where a row is one (query token, q head of that kv head's
group): under GQA each K/V tile is read once for the whole group.

Cache rows older than the window are never read, by the kernel or by the twins: the block manager may
free those blocks, and their block-table entries may then point at blocks holding anything (NaN too).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._backend import cdiv, check, jit, launchable, next_pow2, pick_backend, tl
from .kv_cache import write_kv_cache


@jit
def _paged_attention_kernel(
    q_ptr,  # [T, Hq, D] packed queries
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, Hk, D]
    out_ptr,  # [T, Hq, D]
    cu_q_ptr,  # [S + 1] int32 query offsets
    ctx_ptr,  # [S] int32 cached tokens per sequence (new ones included)
    bt_ptr,  # [S, max_blocks] int32 block tables
    scale,  # softmax scale
    stride_qt, stride_qh,  # q strides (token, head)
    stride_cb, stride_ct, stride_ch,  # cache strides (block, offset, head), shared by k and v
    stride_ot, stride_oh,  # out strides (token, head)
    stride_bt,  # block table row stride
    window,  # sliding window in keys (HAS_WINDOW only)
    GROUP: tl.constexpr,  # q heads per kv head
    HEAD_DIM: tl.constexpr,  # head_dim
    BLOCK_SIZE: tl.constexpr,  # cache block size (tokens)
    IEEE: tl.constexpr,  # fp32 inputs: exact fp32 dots
    HAS_WINDOW: tl.constexpr,  # a row sees only keys k with q_pos - window < k <= q_pos
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,  # rows, keys, head_dim tile
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    ctx = tl.load(ctx_ptr + seq)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < q_len
    q_pos = ctx - q_len + tok  # absolute position of each row's token
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
    # Keys past the last valid row's position are never needed (causal).
    last_tok = tl.minimum(tl.program_id(2) * BLOCK_M + BLOCK_M - 1, q_len * GROUP - 1) // GROUP
    kv_end = tl.where(tl.program_id(2) * BLOCK_M < q_len * GROUP, ctx - q_len + last_tok + 1, 0)
    kv_start = 0
    if HAS_WINDOW:  # keys before the first row's window: never loaded (their blocks may be freed)
        kv_start = tl.maximum(ctx - q_len + (tl.program_id(2) * BLOCK_M) // GROUP - window + 1, 0)
    for start in range(kv_start, kv_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_end
        blk = tl.load(bt_ptr + seq * stride_bt + keys // BLOCK_SIZE, mask=key_ok, other=0)
        off = blk.to(tl.int64) * stride_cb + (keys % BLOCK_SIZE) * stride_ct + kvh * stride_ch  # big caches: int64
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if HAS_WINDOW:  # later rows' windows start later than the first row's
            visible = visible & (keys[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s * scale, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@dataclass(frozen=True)
class StepMetadata:
    """Where a step's packed batch of new tokens goes and what it attends to (the kernels' own view of a
    step: the serve runner builds one from its StepInput).

    positions [T] int64: each new token's position in its sequence (RoPE);
    cu_seqlens_q [S+1] int32: query offsets; context_lens [S] int32: cached tokens per sequence after
    this step is written; block_tables [S, max_blocks] int32; slot_mapping [T] int64: cache slot per
    new token (-1 skips it); max_query_len: the longest run of new tokens of one sequence.
    """

    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one new token."""
        return self.max_query_len == 1


def _gather_seq(cache, block_table, start, ctx):
    """[ctx - start, Hk, D] cached K or V of positions start..ctx-1 of one sequence, in position order;
    blocks before `start`'s are not touched."""
    block_size = cache.shape[1]
    first = start // block_size
    blocks = block_table[first: cdiv(ctx, block_size)].long()
    return cache[blocks].flatten(0, 1)[start - first * block_size: ctx - first * block_size]


def window_start(ctx: int, q_len: int, window: int | None) -> int:
    """The first position any of a sequence's `q_len` newest queries sees (0 without a window)."""
    return 0 if window is None else max(0, ctx - q_len - window + 1)


def visible_keys(q_pos: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """[L, C] True where the query at position q_pos[i] sees the key at position keys[j]: causal, and within
    the window (p - window < k <= p) when there is one."""
    mask = keys[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= keys[None, :] > q_pos[:, None] - window
    return mask


def paged_attention_ref(q, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens, scale, window=None):
    """Torch twin: per sequence, gather its blocks (from its window's start) and run causal SDPA in fp32."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    cu, ctxs = cu_seqlens_q.tolist(), context_lens.tolist()
    for s, ctx in enumerate(ctxs):
        qs = q[cu[s]: cu[s + 1]].float().transpose(0, 1)  # [Hq, L, D]
        q_len = qs.shape[1]
        start = window_start(ctx, q_len, window)
        k = _gather_seq(k_cache, block_tables[s], start, ctx).float().transpose(0, 1).repeat_interleave(group, 0)
        v = _gather_seq(v_cache, block_tables[s], start, ctx).float().transpose(0, 1).repeat_interleave(group, 0)
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        mask = visible_keys(q_pos, torch.arange(start, ctx, device=q.device), window)  # [L, ctx - start]
        o = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        out[cu[s]: cu[s + 1]] = o.transpose(0, 1).to(q.dtype)
    return out


def paged_attention_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale, window=None):
    """Torch twin for decode, batched: gather every sequence's blocks once and run one SDPA.

    The q heads of a GQA group become SDPA's query rows over their shared kv head, so K/V are
    never repeated; keys past each sequence's length are masked. With a window, each sequence's last
    `window` cached rows are gathered by slot instead (see `_windowed_decode_ref`).
    """
    if window is not None:
        return _windowed_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale, window)
    num_seqs, hq, d = q.shape
    num_blocks, block_size, hk, _ = k_cache.shape
    used = cdiv(int(context_lens.max()), block_size)
    tables = block_tables[:, :used].long().clamp(0, num_blocks - 1)  # unused entries may be padding
    k = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [S, Hk, used * block_size, D]
    v = v_cache[tables].flatten(1, 2).transpose(1, 2)
    visible = torch.arange(used * block_size, device=q.device)[None, :] < context_lens[:, None]  # [S, keys]
    qg = q.view(num_seqs, hk, hq // hk, d)  # [S, Hk, group, D]
    out = torch.nn.functional.scaled_dot_product_attention(
        qg.float(), k.float(), v.float(), attn_mask=visible[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, hq, d).to(q.dtype)


def _windowed_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale, window):
    """Decode over each sequence's last min(ctx, window) positions, gathered by slot: a shorter sequence's
    padding repeats its newest row (masked), so no row before a window is read, not even to be masked
    (a masked NaN value would still turn the output into NaN)."""
    num_seqs, hq, d = q.shape
    block_size, hk = k_cache.shape[1], k_cache.shape[2]
    lens = context_lens.long().clamp(max=window)  # [S] keys each sequence sees
    j = torch.arange(int(lens.max()), device=q.device)
    pos = context_lens.long()[:, None] - lens[:, None] + j.minimum(lens[:, None] - 1)  # [S, L] positions
    slots = block_tables.long().gather(1, pos // block_size) * block_size + pos % block_size
    k = k_cache.flatten(0, 1)[slots].transpose(1, 2)  # [S, Hk, L, D]
    v = v_cache.flatten(0, 1)[slots].transpose(1, 2)
    visible = j[None, :] < lens[:, None]  # [S, L]
    qg = q.view(num_seqs, hk, hq // hk, d)  # [S, Hk, group, D]
    out = torch.nn.functional.scaled_dot_product_attention(
        qg.float(), k.float(), v.float(), attn_mask=visible[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, hq, d).to(q.dtype)


def _check(q, k_cache, v_cache, block_tables):
    check(q.dim() == 3 and k_cache.dim() == 4, "paged attention: q [T, Hq, D], cache [blocks, size, Hk, D]")
    check(k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(),
          "paged attention: k_cache and v_cache must share shape and strides")
    check(q.shape[2] == k_cache.shape[3] and q.shape[1] % k_cache.shape[2] == 0,
          f"paged attention: q {tuple(q.shape)} does not fit cache heads/dim {tuple(k_cache.shape[2:])}")
    check(k_cache.stride(3) == 1 and q.stride(2) == 1, "paged attention: head_dim must be contiguous")
    check(block_tables.dim() == 2, "paged attention: block_tables must be [S, max_blocks]")


def check_window(window) -> None:
    """ValueError unless `window` is None or a positive int."""
    check(window is None or (isinstance(window, int) and window >= 1),
          f"paged attention: window must be None or a positive int, got {window!r}")


def _launch(q, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens, scale, max_query_len, window=None):
    out = torch.empty_like(q)
    num_seqs, num_kv, group = context_lens.shape[0], k_cache.shape[2], q.shape[1] // k_cache.shape[2]
    rows = max_query_len * group
    block_m = 16 if rows <= 16 else 64
    grid = (num_seqs, num_kv, cdiv(rows, block_m))
    launchable(_paged_attention_kernel, q.device)[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0), window or 0,
        GROUP=group, HEAD_DIM=q.shape[2], BLOCK_SIZE=k_cache.shape[1], IEEE=q.dtype == torch.float32,
        HAS_WINDOW=window is not None,
        # Wider key tiles keep more bytes in flight on a GPU; narrow ones keep interpreted tests
        # multi-tile at small contexts.
        BLOCK_M=block_m, BLOCK_N=64 if q.is_cuda else 32, BLOCK_D=max(16, next_pow2(q.shape[2])),
    )
    return out


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, backend=None, window=None):
    """One new token per sequence: q [S, Hq, D] attends to `context_lens[s]` cached tokens (window: to the
    last `window` of them).

    The new token's K/V must already be in the cache (see `write_kv_cache`). Returns [S, Hq, D].
    """
    _check(q, k_cache, v_cache, block_tables)
    check_window(window)
    check(q.shape[0] == context_lens.shape[0] == block_tables.shape[0],
          "paged_attention_decode: q, context_lens and block_tables disagree on the batch size")
    if pick_backend(q, backend) == "torch":
        return paged_attention_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale, window)
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return _launch(q, k_cache, v_cache, cu, block_tables, context_lens, scale, 1, window)


def paged_attention_prefill(q, k, v, k_cache, v_cache, meta: StepMetadata, scale, backend=None, window=None):
    """Write the new k/v [T, Hk, D] into the cache, then causal attention of q [T, Hq, D].

    Each sequence's queries see its cached prefix (earlier chunks, shared prefix blocks) and
    the new tokens up to their own position (window: only the last `window` positions up to it).
    Returns [T, Hq, D].
    """
    _check(q, k_cache, v_cache, meta.block_tables)
    check_window(window)
    check(q.shape[0] == k.shape[0] == meta.slot_mapping.shape[0], "paged_attention_prefill: token counts differ")
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, backend=backend)
    args = (q, k_cache, v_cache, meta.cu_seqlens_q, meta.block_tables, meta.context_lens, scale)
    if pick_backend(q, backend) == "torch":
        return paged_attention_ref(*args, window)
    return _launch(*args, meta.max_query_len, window)
