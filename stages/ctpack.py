"""compressed-tensors "pack-quantized" layout: b-bit integer codes densely packed into int32 words.

Layout (compressed-tensors 0.20.1, `compressors/pack_quantized`): a signed code q in
[-2^(b-1), 2^(b-1) - 1] is stored unsigned as q + 2^(b-1); along the packed dimension, element i
occupies bits i*b .. i*b + b - 1 of the row's bit stream, word k holding bits 32k .. 32k + 31
(little-end first), so for 4 bits column 8c + j sits in bits 4j..4j+3 of word c and for 8 bits
column 4c + j in bits 8j..8j+7. Widths that do not divide 32 split elements across words. A
row of n codes takes ceil(n * b / 32) words. Words are int32 (two's complement).

Weights pack along the input dimension ([out, in] -> [out, ceil(in*b/32)]); asymmetric zero
points (int8 [out, in/g]) pack along the OUTPUT dimension ([ceil(out*b/32), in/g]).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

_MASK32 = (1 << 32) - 1


def _check_bits(num_bits: int) -> None:
    if not 1 <= num_bits <= 8:
        raise ValueError(f"packing supports 1..8 bits per value (got {num_bits})")


def _bit_positions(n: int, num_bits: int, device) -> tuple[Tensor, Tensor]:
    """Word index and bit offset of each of n elements in the packed stream."""
    start = torch.arange(n, device=device, dtype=torch.int64) * num_bits
    return start // 32, start % 32


def pack_to_int32(q: Tensor, num_bits: int, packed_dim: int = 1) -> Tensor:
    """Pack int8 codes [rows, cols] (signed, num_bits wide) into int32 along packed_dim."""
    _check_bits(num_bits)
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"expected a 2-D int8 tensor of codes, got {q.dtype} {tuple(q.shape)}")
    lo, hi = -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1
    if q.numel() and (q.min() < lo or q.max() > hi):
        raise ValueError(f"codes outside the signed {num_bits}-bit range [{lo}, {hi}]")
    u = q.to(torch.int64) + (1 << (num_bits - 1))  # unsigned codes
    if packed_dim == 0:
        u = u.t()
    rows, cols = u.shape
    n_words = math.ceil(cols * num_bits / 32)
    word, off = _bit_positions(cols, num_bits, u.device)
    # Fields never overlap, so adding them is OR-ing them; int64 holds a word plus its overflow.
    acc = torch.zeros(rows, n_words + 1, dtype=torch.int64, device=u.device)  # [rows, words + spare]
    acc.index_add_(1, word, (u << off) & _MASK32)
    spill = off + num_bits > 32  # elements that straddle two words
    if spill.any():
        acc.index_add_(1, word[spill] + 1, u[:, spill] >> (32 - off[spill]))
    words = acc[:, :n_words]
    packed = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # two's complement
    return (packed.t() if packed_dim == 0 else packed).contiguous()


UNPACK_ROWS = 1024  # rows `unpack_from_int32` unpacks at once


def unpack_from_int32(packed: Tensor, num_bits: int, shape, packed_dim: int = 1) -> Tensor:
    """Inverse of pack_to_int32: int8 codes of the original 2-D `shape`."""
    _check_bits(num_bits)
    if packed.dtype != torch.int32:
        raise ValueError(f"expected int32 words, got {packed.dtype}")
    words = packed.t() if packed_dim == 0 else packed  # [rows, n_words]
    cols = int(shape[packed_dim])
    word, off = _bit_positions(cols, num_bits, words.device)
    q = torch.empty(words.shape[0], cols, dtype=torch.int8, device=words.device)
    # UNPACK_ROWS rows at a time: the int64 intermediates of a whole embedding table took 25x its size
    for start in range(0, words.shape[0], UNPACK_ROWS):
        w = words[start:start + UNPACK_ROWS].to(torch.int64) & _MASK32  # unsigned view
        w = torch.nn.functional.pad(w, (0, 1))  # a spare word for straddling reads
        u = ((w[:, word] >> off) | (w[:, word + 1] << (32 - off))) & ((1 << num_bits) - 1)  # [rows, cols]
        q[start:start + UNPACK_ROWS] = u - (1 << (num_bits - 1))
    return (q.t() if packed_dim == 0 else q).contiguous()


def pack_int4(q: Tensor) -> Tensor:
    """int4 codes int8 [out, in] in [-8, 7] -> int32 [out, ceil(in / 8)]."""
    return pack_to_int32(q, 4)


def unpack_int4_signed(packed: Tensor, in_features: int) -> Tensor:
    """int32 [out, ceil(in / 8)] -> signed int4 codes int8 [out, in] in [-8, 7] (the stored value - 8)."""
    return unpack_from_int32(packed, 4, (packed.shape[0], in_features))


def pack_zero_point(zero_point: Tensor, num_bits: int) -> Tensor:
    """Asymmetric zero points int8 [out, in/g] -> int32 [ceil(out * b / 32), in/g] (packed over out)."""
    return pack_to_int32(zero_point, num_bits, packed_dim=0)


def unpack_zero_point(packed: Tensor, num_bits: int, out_features: int) -> Tensor:
    """Inverse of pack_zero_point: int8 [out, in/g]."""
    return unpack_from_int32(packed, num_bits, (out_features, packed.shape[1]), packed_dim=0)
