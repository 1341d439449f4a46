"""Fold a per-input-channel scale s into a model without changing what it computes.

AWQ and SmoothQuant both rewrite  y = x @ W^T  as  (x / s) @ (W * s)^T : the weights W * s are
what gets quantized, and the division x / s is absorbed by whatever produced x — the weight (and
bias) of the preceding norm, or the output rows of the preceding linear (e.g. up_proj before
down_proj). All functions are pure: they return new tensors in the inputs' dtype, computed in
float32, and the caller assigns them.

Only plain `y = norm(x) * weight (+ bias)` norms fold this way; norms that compute
`norm(x) * (1 + weight)` (Gemma) need the offset handled by the caller.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _check(s: Tensor, n: int, what: str) -> Tensor:
    if s.dim() != 1 or s.numel() != n:
        raise ValueError(f"scale has shape {tuple(s.shape)}, expected [{n}] to match the {what}")
    if not torch.all(torch.isfinite(s) & (s > 0)):
        raise ValueError("scales must be finite and positive")
    return s.float()


def apply_scale_to_norm(norm_weight: Tensor, s: Tensor, norm_bias: Tensor | None = None):
    """The norm's (weight / s, bias / s): its output, the next linears' input, is divided by s."""
    s = _check(s, norm_weight.numel(), "norm weight")
    weight = (norm_weight.float() / s).to(norm_weight.dtype)
    bias = None if norm_bias is None else (norm_bias.float() / s).to(norm_bias.dtype)
    return weight, bias


def apply_scale_to_linears(weights: list[Tensor], s: Tensor) -> list[Tensor]:
    """Each W [out_i, in] multiplied by s along the input dimension."""
    out = []
    for w in weights:
        sc = _check(s, w.shape[1], "linear's input size")
        out.append((w.float() * sc.unsqueeze(0)).to(w.dtype))  # s broadcast over rows: [1, in]
    return out


def apply_scale_to_prev_linear(prev_w: Tensor, s: Tensor, prev_bias: Tensor | None = None):
    """The previous linear's (rows / s, bias / s): its output channels feed the scaled inputs."""
    s = _check(s, prev_w.shape[0], "previous linear's output size")
    weight = (prev_w.float() / s.unsqueeze(1)).to(prev_w.dtype)  # s over output rows: [out, 1]
    bias = None if prev_bias is None else (prev_bias.float() / s).to(prev_bias.dtype)
    return weight, bias
