"""GGUF blocks filled from the integer codes and scales an artifact stores (no rounding), and llama.cpp's row
order for a Llama query or key projection. Pure functions on tensors.

The layouts (gguf 0.19, `gguf/quants.py`; ggml's block_q4_0 and block_q8_0), 32 weights a block, little-endian:
- Q4_0, 18 bytes: fp16 d, then 16 bytes; byte j holds weight j in its low nibble and weight j + 16 in its high
  nibble, each stored as q + 8, so w = d * (stored - 8) = d * q.
- Q8_0, 34 bytes: fp16 d, then 32 int8 q; w = d * q.
A symmetric int4 (int8) code of compressed-tensors is such a q ([-8, 7], [-128, 127]), and its scale is such a d
when the groups are 32 wide and the scale is an fp16 number. Then d * q, computed in fp32 by any reader, equals
the artifact's (q - 0) * scale exactly: both are exact products (11 + 8 significant bits fit fp32's 24).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

BLOCK = 32  # weights per Q4_0 / Q8_0 block
CODE_RANGE = {4: (-8, 7), 8: (-128, 127)}  # bits -> the signed codes a Q4_0 / Q8_0 block holds


def fp16_exact(scale: Tensor) -> bool:
    """Whether every scale is itself an fp16 number (finite, and not merely rounded to one)."""
    half = scale.to(torch.float16)
    return bool(torch.isfinite(half).all()) and torch.equal(half.float(), scale.float())


def pack_blocks(q: Tensor, d: Tensor, bits: int) -> np.ndarray:
    """Q4_0 (bits 4) or Q8_0 (bits 8) blocks, uint8 [rows, cols / 32 * type size], from signed codes q int8
    [rows, cols] and one scale per 32 codes d [rows, cols / 32] (rounded to fp16 here: callers that need the
    blocks exact check `fp16_exact` first)."""
    rows, cols = q.shape
    if cols % BLOCK or tuple(d.shape) != (rows, cols // BLOCK):
        raise ValueError(f"codes {tuple(q.shape)} and scales {tuple(d.shape)} are not groups of {BLOCK}")
    lo, hi = CODE_RANGE[bits]
    if q.dtype != torch.int8 or (q.numel() and not lo <= int(q.min()) <= int(q.max()) <= hi):
        raise ValueError(f"{bits}-bit blocks take int8 codes in [{lo}, {hi}]")
    blocks = cols // BLOCK
    if bits == 4:
        stored = (q + 8).contiguous().view(torch.uint8).reshape(rows, blocks, 2, BLOCK // 2)  # [R, B, 2, 16], 0..15
        qs = stored[:, :, 0] | (stored[:, :, 1] << 4)  # [R, B, 16]: weight j low, weight j + 16 high
    else:
        qs = q.contiguous().view(torch.uint8).reshape(rows, blocks, BLOCK)  # [R, B, 32]: the int8 bytes
    scale = d.to(torch.float16).contiguous().view(torch.uint8).reshape(rows, blocks, 2)  # [R, B, 2] fp16 bytes
    return torch.cat([scale, qs], dim=-1).reshape(rows, -1).numpy()  # [R, B * (2 + 16 | 32)]


def llama_rows(w: Tensor, heads: int) -> Tensor:
    """llama.cpp's order of the output rows of a Llama query (heads = attention heads) or key (KV heads)
    projection: within a head the two rotary halves interleave, row (h, i, r) -> (h, r, i). Any tensor whose
    rows follow the weight's (codes, scales, zero points, bias) takes the same order; transformers' GGUF loader
    undoes it (`LlamaTensorProcessor`)."""
    half = w.shape[0] // heads // 2
    # [rows, ...] -> [H, 2, half, ...] -> [H, half, 2, ...] -> [rows, ...]
    return w.reshape(heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
