"""compressed-tensors "pack-quantized" layout: b-bit integer codes densely packed into int32 words.

The packing itself is compressed-tensors' (`compressors.pack_quantized.helpers`): measured faster than the
copy we kept before at every shape we use (docs/quantize.md, "Packing"; `scripts/bench_ctpack.py`), so
this module only adds what the library leaves to its callers: refusing codes outside the b-bit range
(the library would silently corrupt neighbouring fields), unpacking a large table a slice of rows at a
time (bounded memory), and contiguous results.

Layout (compressed-tensors 0.20.1): a signed code q in [-2^(b-1), 2^(b-1) - 1] is stored unsigned as
q + 2^(b-1); element i occupies bits i*b .. i*b + b - 1 of the row's bit stream, so for 4 bits column
8c + j sits in bits 4j..4j+3 of word c. A row of n codes takes ceil(n * b / 32) int32 words.
Weights pack along the input dimension ([out, in] -> [out, ceil(in*b/32)]); asymmetric zero
points (int8 [out, in/g]) pack along the OUTPUT dimension ([ceil(out*b/32), in/g]).
"""
from __future__ import annotations

import torch
from torch import Tensor

UNPACK_ROWS = 1024  # rows `unpack_from_int32` unpacks at once: the library's intermediates are 4 bytes a code


def _library():
    # imported on first use: the whole compressed_tensors package loads with it (~0.5 s), which a server
    # of a symmetric artifact never needs
    from compressed_tensors.compressors.pack_quantized import helpers

    return helpers


def _check_bits(num_bits: int) -> None:
    if not 1 <= num_bits <= 8:
        raise ValueError(f"packing supports 1..8 bits per value (got {num_bits})")


def pack_to_int32(q: Tensor, num_bits: int, packed_dim: int = 1) -> Tensor:
    """Pack int8 codes [rows, cols] (signed, num_bits wide) into int32 along packed_dim."""
    _check_bits(num_bits)
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"expected a 2-D int8 tensor of codes, got {q.dtype} {tuple(q.shape)}")
    lo, hi = -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1
    if q.numel() and (q.min() < lo or q.max() > hi):
        raise ValueError(f"codes outside the signed {num_bits}-bit range [{lo}, {hi}]")
    return _library().pack_to_int32(q, num_bits, packed_dim).contiguous()


def unpack_from_int32(packed: Tensor, num_bits: int, shape, packed_dim: int = 1) -> Tensor:
    """Inverse of pack_to_int32: int8 codes of the original 2-D `shape`."""
    _check_bits(num_bits)
    if packed.dtype != torch.int32:
        raise ValueError(f"expected int32 words, got {packed.dtype}")
    words = packed.t() if packed_dim == 0 else packed  # [rows, n_words]
    cols = int(shape[packed_dim])
    q = torch.empty(words.shape[0], cols, dtype=torch.int8, device=words.device)  # [rows, cols]
    library = _library()
    for start in range(0, words.shape[0], UNPACK_ROWS):
        part = words[start:start + UNPACK_ROWS]
        if part.stride(-1) != 1 or not part.is_contiguous():
            # also [rows, 1] seen through a transpose: "contiguous" to torch, but the library views it as bytes
            part = torch.empty_like(part, memory_format=torch.contiguous_format).copy_(part)
        q[start:start + UNPACK_ROWS] = library.unpack_from_int32(part, num_bits, torch.Size((part.shape[0], cols)))
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
