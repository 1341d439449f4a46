"""Rotary position embedding (RoPE), applied to q and k in place, plus its cos/sin cache.

Cache layout: `cos_sin_cache` [max_positions, rot_dim] holds cos in the first rot_dim/2
columns and sin in the last rot_dim/2, one row per position, so one gather per token suffices.
`is_neox=True` rotates the two halves of the rotary dims (Llama, GPT-NeoX in HF);
`is_neox=False` rotates interleaved pairs (GPT-J). Dims past rot_dim are left alone.
"""
from __future__ import annotations

import math

import torch

from ._backend import check, jit, launchable, next_pow2, pick_backend, tl


@jit
def _rotary_kernel(
    x_ptr,  # [tokens, heads, head_dim] q or k, rotated in place
    pos_ptr,  # [tokens] int position of each token
    cache_ptr,  # [max_positions, rot_dim] cos || sin
    stride_xt,  # token stride of x
    stride_xh,  # head stride of x
    stride_ct,  # row stride of the cache
    HALF: tl.constexpr,  # rot_dim // 2
    IS_NEOX: tl.constexpr,  # halves (True) or interleaved pairs (False)
    BLOCK: tl.constexpr,  # power of two >= HALF
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    pos = tl.load(pos_ptr + tok)
    cos = tl.load(cache_ptr + pos * stride_ct + i, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_ct + HALF + i, mask=mask, other=0.0).to(tl.float32)
    if IS_NEOX:
        i1 = i
        i2 = i + HALF
    else:
        i1 = 2 * i
        i2 = 2 * i + 1
    base = x_ptr + tok * stride_xt + head * stride_xh
    x1 = tl.load(base + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + i2, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + i1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + i2, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3.1 frequency-dependent scaling: long wavelengths slowed by `factor`, short kept."""
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    # Wavelengths beyond old_ctx/low give smooth=0 (fully scaled), below old_ctx/high smooth=1 (kept).
    return blended


def build_cos_sin_cache(head_dim, max_positions, theta=10000.0, rope_scaling=None, rotary_dim=None,
                        dtype=torch.float32, device=None):
    """cos||sin cache [max_positions, rotary_dim] for RoPE.

    `rope_scaling` is the HF config dict (`rope_scaling` or `rope_parameters`); supported
    `rope_type`s: "default", "linear" (positions / factor), "llama3" (factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings). A `rope_theta` inside it wins.
    """
    rot = rotary_dim or head_dim
    check(rot % 2 == 0, f"rotary_dim {rot} must be even")
    scaling = dict(rope_scaling or {})
    theta = float(scaling.get("rope_theta", theta))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    inv_freq = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    pos = torch.arange(max_positions, dtype=torch.float64)
    if kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind == "linear":
        pos = pos / float(scaling["factor"])
    elif kind != "default":
        raise ValueError(f"rope_type {kind!r} is not supported (default, linear, llama3)")
    freqs = torch.outer(pos, inv_freq)  # [P, rot/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype=dtype, device=device)


def _rotate_ref(x, cos, sin, is_neox):
    """x [T, H, D] rotated over its first 2*cos.shape[-1] dims; cos/sin [T, 1, rot/2]."""
    half = cos.shape[-1]
    rot = x[..., : 2 * half].to(cos.dtype)
    if is_neox:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    x[..., : 2 * half] = out.to(x.dtype)


def apply_rotary_ref(q, k, positions, cos_sin_cache, is_neox=True):
    """Torch twin of `apply_rotary`: same in-place contract, fp32 (or fp64) arithmetic."""
    half = cos_sin_cache.shape[-1] // 2
    compute = torch.promote_types(torch.promote_types(q.dtype, cos_sin_cache.dtype), torch.float32)
    cs = cos_sin_cache[positions.long()].to(compute)  # [T, rot]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for x in (q, k):
        _rotate_ref(x, cos, sin, is_neox)
    return q, k


def apply_rotary(q, k, positions, cos_sin_cache, is_neox=True, backend=None):
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place by each token's position; returns (q, k).

    `positions` [T] indexes rows of `cos_sin_cache` (see `build_cos_sin_cache`). q and k may be
    strided views (e.g. slices of a fused qkv projection) as long as head_dim is contiguous.
    """
    check(q.dim() == 3 and k.dim() == 3, "apply_rotary: q and k must be [tokens, heads, head_dim]")
    check(q.shape[0] == k.shape[0] == positions.shape[0], "apply_rotary: q, k, positions disagree on tokens")
    check(cos_sin_cache.shape[-1] <= q.shape[-1], "apply_rotary: rotary dim exceeds head_dim")
    if pick_backend(q, backend) == "torch":
        return apply_rotary_ref(q, k, positions, cos_sin_cache, is_neox)
    half = cos_sin_cache.shape[-1] // 2
    for x in (q, k):
        check(x.stride(-1) == 1, "apply_rotary: head_dim must be contiguous")
        if x.shape[0] == 0:
            continue
        launchable(_rotary_kernel, x.device)[(x.shape[0], x.shape[1])](
            x, positions, cos_sin_cache, x.stride(0), x.stride(1), cos_sin_cache.stride(0),
            HALF=half, IS_NEOX=is_neox, BLOCK=next_pow2(half),
        )
    return q, k
