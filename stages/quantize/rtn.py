"""Integer grids and round-to-nearest quantization, group-wise, in compressed-tensors' conventions.

The artifacts we write are read back by transformers + compressed-tensors (and vLLM), which
dequantize with the stored scale and zero point; so every formula here follows
compressed-tensors 0.20.1 (`calculate_qparams`, `lifecycle.forward.quantize/dequantize`) operation
for operation, which makes our dequantized weights bit-exact with theirs:

- signed grid [-2^(b-1), 2^(b-1) - 1]; the range of each group always includes 0.
- symmetric: scale = absmax / ((2^b - 1) / 2)  (absmax / 7.5 for 4 bits, / 127.5 for 8 bits),
  no zero point (the format drops it).
- asymmetric: scale = (max - min) / (2^b - 1), zero = round(clamp(qmin - min / scale)) as int8.
- a scale of exactly 0 (an all-zero group) becomes the float eps of the scale's dtype.
- q = round(clamp(w / scale + zero, qmin, qmax)) (round half to even); w' = (q - zero) * scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

import llmopt.kernels as kernels

from ..errors import ConfigError

AUTO_GROUP_SIZES = (128, 64, 32)


@dataclass(frozen=True)
class QuantArgs:
    bits: int
    group_size: int  # -1 = per output channel
    symmetric: bool = True
    # Scales are stored in the checkpoint's dtype (compressed-tensors does the same); rounding them
    # before quantizing keeps the codes optimal for, and the dequantized weights equal to, what is stored.
    scale_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ConfigError(f"weight bits must lie in 2..8 (got {self.bits})")
        if self.group_size != -1 and self.group_size < 1:
            raise ConfigError(f"group size must be -1 (per channel) or positive (got {self.group_size})")

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1


def resolve_group_size(in_features: int, requested: int | None, layer: str = "") -> int:
    """The group size for a layer: None (auto) picks 128, else 64, else 32 where it divides, else -1;
    a requested size (checked by QuantizeConfig) must divide the layer's input size."""
    where = f"layer {layer}" if layer else "the layer"
    valid = [g for g in AUTO_GROUP_SIZES if in_features % g == 0] + [-1]
    if requested is None:
        return valid[0]
    if requested != -1 and in_features % requested:
        raise ConfigError(f"group size {requested} does not divide the input size {in_features} of {where}; "
                          f"valid sizes: {', '.join(map(str, valid))} (or auto)")
    return requested


def group_width(in_features: int, args: QuantArgs) -> int:
    """Columns per group: the whole row when per channel; raises if the size does not divide."""
    if args.group_size == -1:
        return in_features
    if in_features % args.group_size:
        raise ConfigError(f"group size {args.group_size} does not divide the input size {in_features}")
    return args.group_size


def _groups(w: Tensor, args: QuantArgs) -> Tensor:
    out, cols = w.shape
    g = group_width(cols, args)
    return w.reshape(out, cols // g, g)  # [out, in/g, g]


def qparams_from_minmax(min_vals: Tensor, max_vals: Tensor, args: QuantArgs) -> tuple[Tensor, Tensor | None]:
    """Scale and zero point (int8, None when symmetric) from per-group minima and maxima."""
    # 0 must stay representable: pruned zeros and padding dequantize to exactly 0.
    min_vals = torch.clamp(min_vals, max=0)
    max_vals = torch.clamp(max_vals, min=0)
    bit_range = float(args.qmax - args.qmin)
    if args.symmetric:
        scale = torch.maximum(min_vals.abs(), max_vals) / (bit_range / 2)
    else:
        scale = (max_vals - min_vals) / bit_range
    if args.scale_dtype is not None and args.scale_dtype != scale.dtype:
        scale = scale.to(args.scale_dtype).to(scale.dtype)
    zero = None
    if not args.symmetric:
        # An all-zero group gives 0/0 = NaN; any integer zero point maps 0 to 0 there, take 0.
        zero = torch.clamp(args.qmin - min_vals / scale, args.qmin, args.qmax).nan_to_num(0.0)
        zero = torch.round(zero).to(torch.int8)
    return torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale), zero


OBSERVERS = ("minmax", "mse")


def compute_qparams(w: Tensor, args: QuantArgs, observer: str = "minmax") -> tuple[Tensor, Tensor | None]:
    """qparams of w [out, in]: scale [out, in/g] float32 (float64 for float64 w), zero or None.

    observer "minmax": each group's range is its min..max. "mse": the range shrunk (by up to 20%,
    in 1% steps) to whichever minimises the group's sum of |w - dequantized|^2.4, the error measure
    of GPTQ's and llm-compressor's MSE observers: a few outliers no longer stretch the grid for
    every other weight of the group. min..max is among the candidates, so the error never rises.
    """
    wg = _groups(w.to(_work_dtype(w)), args)  # [out, in/g, g]
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    if observer == "minmax":
        return qparams_from_minmax(lo, hi, args)
    if observer != "mse":
        raise ConfigError(f"unknown observer {observer!r}; choose one of {', '.join(OBSERVERS)}")
    return _mse_qparams(wg, lo, hi, args)


def _mse_qparams(wg: Tensor, lo: Tensor, hi: Tensor, args: QuantArgs, grid: int = 20, max_shrink: float = 0.2,
                 norm: float = 2.4) -> tuple[Tensor, Tensor | None]:
    best_scale, best_zero = qparams_from_minmax(lo, hi, args)
    best_err = _group_error(wg, best_scale, best_zero, args, norm)
    for i in range(1, grid + 1):
        shrink = 1 - max_shrink * i / grid
        scale, zero = qparams_from_minmax(lo * shrink, hi * shrink, args)
        err = _group_error(wg, scale, zero, args, norm)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        if zero is not None:
            best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def _group_error(wg: Tensor, scale: Tensor, zero: Tensor | None, args: QuantArgs, norm: float) -> Tensor:
    """sum over each group of |w - dequantize(quantize(w))|^norm: [out, in/g]."""
    x = wg / scale.unsqueeze(-1)
    if zero is not None:
        x = x + zero.unsqueeze(-1).to(wg.dtype)
    q = torch.round(torch.clamp(x, args.qmin, args.qmax))
    if zero is not None:
        q = q - zero.unsqueeze(-1).to(wg.dtype)
    return (q * scale.unsqueeze(-1) - wg).abs_().pow_(norm).sum(-1)


def quantize(w: Tensor, scale: Tensor, zero_point: Tensor | None, args: QuantArgs) -> Tensor:
    """Integer codes int8 [out, in] in [qmin, qmax] of w on the grid (scale, zero_point)."""
    wg = _groups(w, args)  # [out, in/g, g]
    x = wg / scale.unsqueeze(-1)
    if zero_point is not None:
        x = x + zero_point.unsqueeze(-1).to(w.dtype)
    return torch.round(torch.clamp(x, args.qmin, args.qmax)).to(torch.int8).reshape(w.shape)


def dequantize(q: Tensor, scale: Tensor, zero_point: Tensor | None, args: QuantArgs) -> Tensor:
    """Float weights (scale's dtype) [out, in] from codes: (q - zero) * scale (`llmopt.kernels.dequantize`)."""
    return kernels.dequantize(q, scale, zero_point, group_width(q.shape[1], args), scale.dtype)


def fake_quantize(w: Tensor, args: QuantArgs, scale: Tensor | None = None,
                  zero_point: Tensor | None = None) -> Tensor:
    """Quantize then dequantize w (qparams computed by RTN when not given); returns w's dtype."""
    if scale is None:
        scale, zero_point = compute_qparams(w, args)
    q = quantize(w, scale, zero_point, args)
    return dequantize(q, scale, zero_point, args).to(w.dtype)


def _work_dtype(w: Tensor) -> torch.dtype:
    # float64 stays float64 (reference tests); everything else is computed in float32.
    return torch.float64 if w.dtype == torch.float64 else torch.float32
