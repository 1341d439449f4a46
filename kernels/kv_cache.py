"""Scatter new keys/values into the paged KV cache by slot (layout: see `paged_attention`)."""
from __future__ import annotations

import torch

from ._backend import check, jit, launchable, next_pow2, pick_backend, tl


@jit
def _write_kv_kernel(
    k_ptr, v_ptr,  # [T, Hk, D] new keys / values
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, Hk, D]
    slot_ptr,  # [T] int64 slot = block * block_size + offset; negative = skip (padding)
    stride_kt, stride_kh,  # k strides (token, head)
    stride_vt, stride_vh,  # v strides (token, head)
    stride_cb, stride_ct, stride_ch,  # cache strides (block, offset, head)
    HEAD_DIM: tl.constexpr,  # head_dim
    BLOCK_SIZE: tl.constexpr,  # cache block size (tokens)
    BLOCK_D: tl.constexpr,  # power of two >= head_dim
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + tok)
    d = tl.arange(0, BLOCK_D)
    mask = (d < HEAD_DIM) & ((d * 0 + slot) >= 0)  # vector-shaped: the interpreter rejects scalar masks
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + head * stride_ch + d
    k = tl.load(k_ptr + tok * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + head * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping):
    """Torch twin: index_put of each valid token's K/V into (block, offset)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block_size = k_cache.shape[1]
    k_cache[slots // block_size, slots % block_size] = k[valid].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = v[valid].to(v_cache.dtype)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, backend=None):
    """Store k, v [T, Hk, D] at `slot_mapping` [T] in the caches, in place (slot < 0: skipped)."""
    check(k.shape == v.shape and k.dim() == 3, "write_kv_cache: k and v must both be [T, Hk, D]")
    check(k.shape[1:] == k_cache.shape[2:], f"write_kv_cache: k {tuple(k.shape)} vs cache {tuple(k_cache.shape)}")
    check(slot_mapping.shape == (k.shape[0],), "write_kv_cache: one slot per token")
    if pick_backend(k, backend) == "torch":
        return write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)
    check(k.dtype == k_cache.dtype, "write_kv_cache: k/v dtype must match the cache on the triton path")
    check(k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1, "write_kv_cache: head_dim contiguous")
    check(k_cache.stride() == v_cache.stride(), "write_kv_cache: k_cache and v_cache must share strides")
    if k.shape[0] == 0:
        return None
    launchable(_write_kv_kernel, k.device)[(k.shape[0], k.shape[1])](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=k.shape[2], BLOCK_SIZE=k_cache.shape[1], BLOCK_D=next_pow2(k.shape[2]),
    )
    return None
