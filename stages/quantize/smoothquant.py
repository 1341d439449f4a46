"""SmoothQuant (Xiao et al., 2022) and the W8A8 numerics it targets.

A few activation channels are far larger than the rest, which ruins per-token int8 activation
quantization. Dividing those channels by s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) and
multiplying the matching weight columns by s_j (fold.py) moves the difficulty into the weights,
which per-channel int8 handles well.

Numerics follow compressed-tensors' W8A8 scheme (what transformers and vLLM load): weights int8
symmetric per output channel, activations int8 symmetric per token, computed at run time; both
use scale = absmax / 127.5 and q = clamp(round(x / scale), -128, 127).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .fold import apply_scale_to_linears, apply_scale_to_norm, apply_scale_to_prev_linear
from .rtn import QuantArgs, compute_qparams, qparams_from_minmax, quantize

__all__ = ["smooth_scales", "quantize_weight_int8_per_channel", "quantize_act_per_token",
           "w8a8_linear_ref", "apply_scale_to_norm", "apply_scale_to_linears", "apply_scale_to_prev_linear"]

INT8_CHANNEL = QuantArgs(bits=8, group_size=-1, symmetric=True)
SCALE_BOUNDS = (1e-5, 1e5)


def smooth_scales(act_absmax: Tensor, weights: list[Tensor], alpha: float = 0.5) -> Tensor:
    """Per-input-channel smoothing scale s [in] from activation absmax [in] and the linears' weights.

    Channels with no activation or no weight get s = 1 (nothing to migrate); the rest are clamped
    to [1e-5, 1e5] so a near-dead channel cannot blow up the folded norm weight.
    """
    if not 0 <= alpha <= 1:
        raise ValueError(f"smoothing alpha must lie in [0, 1] (got {alpha})")
    a = act_absmax.float()
    w_absmax = torch.cat([w.float().abs() for w in weights], dim=0).amax(dim=0)  # [in]
    s = a.pow(alpha) / w_absmax.pow(1 - alpha)
    s = s.clamp(*SCALE_BOUNDS)
    return torch.where((a > 0) & (w_absmax > 0) & torch.isfinite(s), s, torch.ones_like(s))


def quantize_weight_int8_per_channel(w: Tensor) -> tuple[Tensor, Tensor]:
    """int8 codes [out, in] and float32 scales [out, 1] (compressed-tensors' W8A8 weight layout)."""
    scale, _ = compute_qparams(w, INT8_CHANNEL)  # [out, 1]
    return quantize(w.float(), scale, None, INT8_CHANNEL), scale


def quantize_act_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic symmetric int8 per token: codes [..., in] and float32 scales [..., 1]."""
    xf = x.float()
    absmax = xf.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    scale, _ = qparams_from_minmax(-absmax, absmax, INT8_CHANNEL)
    q = torch.round(torch.clamp(xf / scale, INT8_CHANNEL.qmin, INT8_CHANNEL.qmax)).to(torch.int8)
    return q, scale


def w8a8_linear_ref(x: Tensor, q_w: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """Reference W8A8 linear: int8 x int8 with exact integer accumulation, then both scales.

    The accumulation runs as a float64 matmul, exact because every partial sum of int8 products
    stays far below 2^53. Returns x's dtype.
    """
    q_x, x_scale = quantize_act_per_token(x)  # [..., in], [..., 1]
    acc = q_x.double() @ q_w.double().t()  # exact int32-range sums: [..., out]
    y = acc * x_scale.double() * w_scale.double().reshape(1, -1)  # per token x per channel
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)
