"""Weight-only quantized matmul `y = x @ dequant(W).T` on the compressed-tensors layout.

W4A16 ("pack-quantized"): `weight_packed` int32 [N, ceil(K/8)], input column 8c+j in bits
4j..4j+3 of word c, each value stored as q+8 (unsigned 0..15); `weight_scale` [N, G] with
G = ceil(K / group_size) (G = 1 for channel-wise); asymmetric schemes add `weight_zero_point`
int32 [ceil(N/8), G], packed along the *output* dim (row 8r+j in bits 4j.. of word r), also
stored +8. Dequant: w = (q_stored - zp_stored) * scale, zp_stored = 8 when symmetric.

W8A16 ("int-quantized"/"naive-quantized"): `weight` int8 [N, K] (signed), `weight_scale`
[N, G], optional `weight_zero_point` int8 [N, G]. Dequant: w = (q - zp) * scale.

Two Triton kernels, both dequantizing in registers inside the K loop (no dequantized copy of the
weight is ever written to memory) and both reading each packed word once, contiguously along K
(`wq_gemv.weight_tile`): up to 16 rows of x, the decode GEMV in `wq_gemv` (the weight is the dot's
A operand, streamed); above that, the tiled kernel here (x [BLOCK_M, BLOCK_K] times the dequantized
tile transposed, split-K while the tiles do not fill the GPU). The `*_ref` twins do materialise the
weight: they are the exact reference (the "reference" backend, and what tests compare against); the
CPU backends use `cpu_quant` and `cpu_native` instead.

Shared layout helpers, named for what they return: `unpack_int4_stored` / `unpack_zero_point_stored`
(stored values 0..15, not signed codes), `resolve_group_size` and `dequantize`, the one dequantizer
every reader of quantized weights uses.
"""
from __future__ import annotations

import sys

import torch

from ._backend import cdiv, check, jit, launchable, pick_backend, tl
from .wq_gemv import (GEMV_MAX_M, ONE, STEP, as_words, gathers_columns, group_mode, group_params, sm_count,
                      weight_tile, wq_gemv)


@jit
def _wq_matmul_kernel(
    x_ptr,  # [M, K] activations (fp32/fp16/bf16)
    w_ptr,  # int32 words [N, KW] (BITS=4: 8 nibbles; BITS=8: 4 int8 codes), or int8 [N, K] when BYTES
    s_ptr,  # [N, G] scales
    z_ptr,  # BITS=4: int32 [ceil(N/8), G] packed along N; BITS=8: int8 [N, G] (if HAS_ZP)
    out_ptr,  # [M, N] output: x's dtype, or fp32 accumulated atomically when SPLIT_K > 1
    M, N, K,  # problem size
    KW,  # words per row, ceil(K / VALS)
    group_size,  # K columns per scale
    kw_per_split,  # words per row per split (a multiple of BLOCK_KW, and of GROUP_WORDS when STEP)
    stride_xm,  # row stride of x
    stride_wn,  # row stride of w, in words (in bytes when BYTES)
    stride_sn,  # row stride of the scales
    stride_zn,  # row stride of the zero points
    stride_om,  # row stride of out
    BITS: tl.constexpr,  # 4 or 8
    HAS_ZP: tl.constexpr,  # asymmetric: read zero points
    GROUPS: tl.constexpr,  # group mode (wq_gemv.group_mode): ONE, STEP, WORD or ELEMENT
    GROUP_WORDS: tl.constexpr,  # words per group (STEP, WORD)
    BYTES: tl.constexpr,  # BITS=8 only: read the int8 weight byte by byte
    IEEE: tl.constexpr,  # fp32 inputs: exact fp32 dot (no tf32)
    SPLIT_K: tl.constexpr,  # programs sharing one output tile along K
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,  # tile sizes (K in words)
):
    VALS: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = BLOCK_KW * VALS
    dtype: tl.constexpr = tl.float32 if IEEE else x_ptr.dtype.element_ty
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n[:, None]  # the weight tile's rows [BLOCK_N, 1]
    mask_r = rows < N
    kw_start = tl.program_id(2) * kw_per_split
    kw_end = tl.minimum(kw_start + kw_per_split, KW)
    row_zero = 8.0 if BITS == 4 else 128.0
    if GROUPS == ONE:
        row_scale, row_zero = group_params(s_ptr, z_ptr, rows, 0, mask_r, stride_sn, stride_zn, BITS, HAS_ZP)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kw0 in range(kw_start, kw_end, BLOCK_KW):
        kw = kw0 + tl.arange(0, BLOCK_KW)
        k = kw0 * VALS + tl.arange(0, BLOCK_K)
        mask_k = (k < K) & (k < kw_end * VALS)
        zero = row_zero
        step_scale = 1.0
        if GROUPS == STEP:  # scaled in the tile: a second [BLOCK_M, BLOCK_N] accumulator would cost registers
            step_scale, zero = group_params(s_ptr, z_ptr, rows, kw0 // GROUP_WORDS, mask_r, stride_sn, stride_zn,
                                            BITS, HAS_ZP)
        w = weight_tile(w_ptr, s_ptr, z_ptr, rows, mask_r, kw[None, :], (kw < kw_end)[None, :], k[None, :],
                        mask_k[None, :], group_size, zero, step_scale, stride_wn, stride_sn, stride_zn, BITS,
                        HAS_ZP, GROUPS, GROUP_WORDS, GROUPS == STEP, BYTES, dtype)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                    mask=(offs_m < M)[:, None] & mask_k[None, :], other=0.0).to(dtype)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee" if IEEE else None)
    if GROUPS == ONE:
        acc *= tl.trans(row_scale)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask_out = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(out_ptrs, acc, mask=mask_out)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)


def unpack_int4_stored(weight_packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 [N, ceil(K/8)] -> uint8 [N, K] of the stored values 0..15 (the signed code + 8)."""
    n = weight_packed.shape[0]
    if sys.byteorder == "little":  # word c's byte b holds columns 8c+2b (low nibble), 8c+2b+1 (high)
        b = weight_packed.contiguous().view(torch.uint8)
        return torch.stack((b & 0xF, b >> 4), dim=-1).view(n, -1)[:, :in_features]
    shifts = torch.arange(0, 32, 4, device=weight_packed.device, dtype=torch.int32)
    nib = (weight_packed.unsqueeze(-1) >> shifts) & 0xF  # [N, K/8, 8]
    return nib.flatten(1)[:, :in_features].to(torch.uint8)


def unpack_zero_point_stored(zp_packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """int32 [ceil(N/8), G] packed along N -> uint8 [N, G] of the stored values 0..15 (zero point + 8)."""
    shifts = torch.arange(0, 32, 4, device=zp_packed.device, dtype=torch.int32)
    nib = (zp_packed.unsqueeze(1) >> shifts[None, :, None]) & 0xF  # [N/8, 8, G]
    return nib.flatten(0, 1)[:out_features].to(torch.uint8)


def resolve_group_size(in_features: int, weight_scale: torch.Tensor, group_size: int | None) -> int:
    """Columns per scale as a number. -1: one group per output channel (compressed-tensors' `strategy:
    channel`); None: inferred from the scales, K / G (channel-wise for [N, 1])."""
    groups = weight_scale.shape[-1] if weight_scale.dim() > 1 else 1
    if group_size == -1:
        group_size = in_features
    elif group_size is None:
        check(in_features % groups == 0,
              f"group_size is required: K={in_features} is not a multiple of {groups} groups")
        group_size = in_features // groups
    check(group_size > 0 and groups == cdiv(in_features, group_size),
          f"weight_scale has {groups} groups; K={in_features} / group {group_size} needs "
          f"{cdiv(in_features, group_size)}")
    return group_size


def dequantize(q, weight_scale, zero=None, group_size=None, dtype=torch.float32):
    """The dense weight [N, K] = (q - zero) * scale, computed in `dtype`: the one dequantizer.

    q [N, K] integer codes (signed, or stored values with `zero` holding the matching offset);
    weight_scale [N, G]; zero: None, a number, or [N, G] per group. group_size: columns per scale,
    -1 for one group per output channel, None to infer it (see `resolve_group_size`). Elementwise in
    `dtype`, so the result is bit-identical to compressed-tensors' `(q - zp) * scale` in that dtype.
    """
    n, k = q.shape
    group = resolve_group_size(k, weight_scale, group_size)
    scale = weight_scale.reshape(n, -1).to(dtype)  # [N, G]
    zero = zero.reshape(n, -1).to(dtype) if torch.is_tensor(zero) else zero
    if k % group:  # a ragged last group: expand the scales over K
        scale = scale.repeat_interleave(group, dim=1)[:, :k]  # [N, K]
        zero = zero.repeat_interleave(group, dim=1)[:, :k] if torch.is_tensor(zero) else zero
        x = q.to(dtype)
    else:  # broadcast each group's scale over its columns instead of expanding it
        x = q.to(dtype).view(n, -1, group)  # [N, G, group]
        scale = scale[..., None]  # [N, G, 1]
        zero = zero[..., None] if torch.is_tensor(zero) else zero
    if zero is not None:
        x = x - zero
    return (x * scale).view(n, k)


def w4a16_dequantize(weight_packed, weight_scale, in_features, weight_zero_point=None, group_size=None,
                     dtype=torch.float32):
    """The dense [N, K] weight that a pack-quantized W4 layer represents."""
    q = unpack_int4_stored(weight_packed, in_features)
    zero = 8 if weight_zero_point is None else unpack_zero_point_stored(weight_zero_point, q.shape[0])
    return dequantize(q, weight_scale, zero, group_size, dtype)


def w4a16_matmul_ref(x, weight_packed, weight_scale, weight_zero_point=None, group_size=None):
    """Torch twin: dequantize to fp32, matmul in fp32, cast to x's dtype."""
    w = w4a16_dequantize(weight_packed, weight_scale, x.shape[-1], weight_zero_point, group_size)
    return (x.float() @ w.t()).to(x.dtype)


def w8a16_matmul_ref(x, weight, weight_scale, weight_zero_point=None, group_size=None):
    """Torch twin for int8 weights: dequantize to fp32, matmul in fp32, cast to x's dtype."""
    w = dequantize(weight, weight_scale, weight_zero_point, group_size)
    return (x.float() @ w.t()).to(x.dtype)


def choose_split_k(tiles: int, k_steps: int, sm_count: int | None) -> int:
    """Split K until the output tiles x splits cover the SMs twice (decode-sized M has few tiles), each
    split keeping at least four K steps. `sm_count` None (CPU): no split."""
    split = 1
    while sm_count and tiles * split * 2 <= 2 * sm_count and k_steps // (split * 2) >= 4:
        split *= 2
    return split


def tile_config(m: int, bits: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_KW, num_warps, num_stages) for the tiled kernel: steps of 128 input columns,
    64 x 64 tiles (4 warps) up to 64 rows of x, 64 x 128 (8 warps) above. fp32 runs an FMA dot (no tf32),
    whose operands take registers per K column: 32 x 64 tiles, steps of 32 columns (none of these spill,
    checked for sm_90)."""
    vals = 32 // bits
    if dtype == torch.float32:
        return 32, 64, 32 // vals, 4, 2
    if m <= 64:
        return 64, 64, 128 // vals, 4, 3
    return 64, 128, 128 // vals, 8, 3


def _unit_stride(t):
    """The kernels step along the last dim by one element (x's K, a weight row, a scale row)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _launch(x, w, scale, zp, n, group_size, bits, split_k):
    k = x.shape[-1]
    x2 = _unit_stride(x.reshape(-1, k))
    w, zp = _unit_stride(w), _unit_stride(zp)
    scale = _unit_stride(scale.reshape(n, -1))  # [N] (channel-wise) -> [N, 1]
    m = x2.shape[0]
    if m == 0:
        return torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if m <= GEMV_MAX_M:
        return wq_gemv(x2, w, scale, zp, n, group_size, bits, split_k).view(*x.shape[:-1], n)
    words = w if bits == 4 else as_words(w)
    wk = words if words is not None else w
    block_m, block_n, block_kw, warps, stages = tile_config(m, bits, x.dtype)
    mode, group_words = group_mode(scale.shape[1], group_size, bits, block_kw)
    if gathers_columns(mode, words is None):  # per-column scale gathers are pipelined too: halve the step
        block_kw, stages = block_kw // 2, 2
    kw = cdiv(k, 32 // bits)
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    split_k = split_k or choose_split_k(tiles, cdiv(kw, block_kw), sm_count(x.device))
    align = group_words if mode == STEP else block_kw  # a split starts on a group boundary when scaled per step
    kw_per_split = cdiv(cdiv(kw, split_k), align) * align
    split_k = cdiv(kw, kw_per_split)
    out = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if split_k > 1
           else torch.empty(m, n, dtype=x.dtype, device=x.device))
    zp_arg = zp if zp is not None else scale
    launchable(_wq_matmul_kernel, x.device)[(cdiv(m, block_m), cdiv(n, block_n), split_k)](
        x2, wk, scale, zp_arg, out, m, n, k, kw, group_size, kw_per_split,
        x2.stride(0), wk.stride(0), scale.stride(0), zp_arg.stride(0), out.stride(0),
        BITS=bits, HAS_ZP=zp is not None, GROUPS=mode, GROUP_WORDS=group_words, BYTES=words is None,
        IEEE=x.dtype == torch.float32, SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KW=block_kw,
        num_warps=warps, num_stages=stages,
    )
    return out.to(x.dtype).view(*x.shape[:-1], n)


def w4a16_matmul(x, weight_packed, weight_scale, weight_zero_point=None, group_size=None, backend=None,
                 split_k=None):
    """`x @ W.T` for a pack-quantized int4 weight; x [..., K] -> [..., N] in x's dtype.

    `group_size` None: inferred from the scales (K / G, or channel-wise for [N, 1]). On "triton", up
    to 16 rows of x run the decode GEMV (`wq_gemv`), more the tiled kernel; `split_k` None: picked
    from the GPU's SM count (CPU: 1). On "torch" this is the reference (it materialises W); the
    quantized `nn.Module`s use the faster CPU layouts in `cpu_quant`.
    """
    k, n = x.shape[-1], weight_packed.shape[0]
    check(weight_packed.dtype == torch.int32 and weight_packed.shape[1] == cdiv(k, 8),
          f"w4a16: weight_packed must be int32 [N, ceil(K/8)] = [{n}, {cdiv(k, 8)}], got "
          f"{weight_packed.dtype} {tuple(weight_packed.shape)}")
    group_size = resolve_group_size(k, weight_scale, group_size)
    if weight_zero_point is not None:
        check(weight_zero_point.shape == (cdiv(n, 8), weight_scale.reshape(n, -1).shape[1]),
              "w4a16: weight_zero_point must be int32 [ceil(N/8), G] (packed along N)")
    if pick_backend(x, backend) == "torch":
        return w4a16_matmul_ref(x, weight_packed, weight_scale, weight_zero_point, group_size)
    return _launch(x, weight_packed, weight_scale, weight_zero_point, n, group_size, 4, split_k)


def w8a16_matmul(x, weight, weight_scale, weight_zero_point=None, group_size=None, backend=None, split_k=None):
    """`x @ W.T` for an int8 weight [N, K] with [N, G] scales (G=1: channel-wise)."""
    check(weight.dtype == torch.int8 and weight.dim() == 2 and weight.shape[1] == x.shape[-1],
          f"w8a16: weight must be int8 [N, {x.shape[-1]}], got {weight.dtype} {tuple(weight.shape)}")
    group_size = resolve_group_size(weight.shape[1], weight_scale, group_size)
    if weight_zero_point is not None:
        check(weight_zero_point.shape == weight_scale.shape, "w8a16: weight_zero_point must match weight_scale")
    if pick_backend(x, backend) == "torch":
        return w8a16_matmul_ref(x, weight, weight_scale, weight_zero_point, group_size)
    return _launch(x, weight, weight_scale, weight_zero_point, weight.shape[0], group_size, 8, split_k)
