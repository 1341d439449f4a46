"""AWQ: activation-aware weight quantization (Lin et al., 2023), the pure search functions.

Weights that multiply large activations matter most. AWQ scales those input channels up before
quantizing (W * s) and divides the activations by s (folded into the preceding norm or linear,
see fold.py), so salient weights use more of the grid; the scale per input channel is
s = mean|x|^alpha / mean|w|^(1 - alpha), alpha chosen on a grid to minimise the output error.
An optional clipping search then shrinks each group's range where that lowers the output error.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .fold import apply_scale_to_linears, apply_scale_to_norm, apply_scale_to_prev_linear
from .rtn import QuantArgs, fake_quantize, group_width

__all__ = ["awq_search_scale", "awq_search_clip", "apply_clip", "fake_quantize_clipped",
           "apply_scale_to_norm", "apply_scale_to_linears", "apply_scale_to_prev_linear"]


def subsample_rows(x: Tensor, max_rows: int, weights: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """x reshaped to [n, in] and its row weights [n]; at most max_rows evenly spaced rows
    (deterministic), in float32. Weights (None: all rows count alike) are normalised to sum to 1."""
    x = x.reshape(-1, x.shape[-1])  # [tokens, in]
    if weights is not None:
        weights = weights.reshape(-1).float()
    if x.shape[0] > max_rows:
        idx = torch.linspace(0, x.shape[0] - 1, max_rows, device=x.device).round().long()
        x = x[idx]
        weights = None if weights is None else weights[idx]
    if weights is not None:
        weights = weights / weights.sum()
    return x.float(), weights


def _row_mean(t: Tensor, weights: Tensor | None) -> Tensor:
    """Mean over dim 0 of t [n, ...], weighted by weights [n] (summing to 1) when given."""
    if weights is None:
        return t.mean(dim=0)
    return torch.tensordot(weights, t, dims=([0], [0]))


def _weight_magnitude(W: Tensor, args: QuantArgs) -> Tensor:
    """Mean over output rows of |w| relative to its group's absmax: [in]."""
    out, cols = W.shape
    g = group_width(cols, args)
    wg = W.abs().reshape(out, cols // g, g)  # [out, in/g, g]
    wg = wg / wg.amax(dim=-1, keepdim=True).clamp(min=1e-8)
    return wg.reshape(out, cols).mean(dim=0)


def awq_search_scale(x: Tensor, weights: list[Tensor], args: QuantArgs, grid: int = 20,
                     max_rows: int = 2048, row_weights: Tensor | None = None) -> tuple[Tensor, float, float]:
    """Best per-input-channel scale s [in] for the linears sharing input x [..., in].

    Loss: MSE between x @ W^T and (x / s) @ fake_quant(W * s)^T over all the linears' outputs
    (W = the weights stacked along the output dimension). s = 1 is always a candidate, so the
    best loss never exceeds the loss without scaling. `row_weights` ([...], one per row of x)
    weigh each token in the loss and in the mean |x| (see `AWQ`: attention sinks). Returns
    (s, best_loss, loss_at_s_equal_1).
    """
    x, rw = subsample_rows(x, max_rows, row_weights)  # [n, in], [n] | None
    W = torch.cat([w.float() for w in weights], dim=0)  # [sum out_i, in]
    ref = x @ W.t()  # [n, sum out_i]
    x_mean = _row_mean(x.abs(), rw).clamp(min=1e-8)
    w_mean = _weight_magnitude(W, args).clamp(min=1e-8)

    def loss_of(s: Tensor) -> float:
        wq = fake_quantize(W * s, args) / s  # == (x / s) @ fq(W * s)^T, without touching x
        return _row_mean((x @ wq.t() - ref).pow(2).mean(dim=1), rw).item()

    best_s = torch.ones_like(x_mean)
    best = loss_at_1 = loss_of(best_s)
    for k in range(grid):
        alpha = k / grid
        s = (x_mean.pow(alpha) / w_mean.pow(1 - alpha)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1 in log space
        if not torch.all(torch.isfinite(s)):
            continue
        loss = loss_of(s)
        if loss < best:
            best, best_s = loss, s
    return best_s, best, loss_at_1


def awq_search_clip(x: Tensor, w: Tensor, args: QuantArgs, grid: int = 20, max_shrink: float = 0.5,
                    max_rows: int = 512, rows_per_chunk: int = 256, row_weights: Tensor | None = None) -> Tensor:
    """Per-group clipping range max_val [out, in/g] minimising each group's output MSE.

    Candidates shrink the group's absmax by k/grid for k < max_shrink * grid; k = 0 (no
    clipping) is among them, so clipping never raises the calibration error. `row_weights` as in
    `awq_search_scale`.
    """
    x, rw = subsample_rows(x, max_rows, row_weights)  # [n, in], [n] | None
    W = w.float()
    out, cols = W.shape
    g = group_width(cols, args)
    xg = x.reshape(x.shape[0], cols // g, g)  # [n, in/g, g]
    chunks = [_clip_chunk(xg, W[r:r + rows_per_chunk], args, grid, max_shrink, rw)
              for r in range(0, out, rows_per_chunk)]
    return torch.cat(chunks, dim=0)


def _clip_chunk(xg: Tensor, W: Tensor, args: QuantArgs, grid: int, max_shrink: float,
                rw: Tensor | None = None) -> Tensor:
    rows, cols = W.shape
    ng, g = xg.shape[1], xg.shape[2]
    wg = W.reshape(rows, ng, g)  # [rows, in/g, g]
    org_max = wg.abs().amax(dim=-1)  # [rows, in/g]
    ref = torch.einsum("ngk,ogk->nog", xg, wg)  # per-group partial outputs [n, rows, in/g]
    best_max, best_err = org_max.clone(), torch.full_like(org_max, float("inf"))
    for k in range(max(1, int(max_shrink * grid))):
        max_val = org_max * (1 - k / grid)
        wq = fake_quantize_clipped(W, max_val, args).reshape(rows, ng, g)  # [rows, in/g, g]
        err = _row_mean((torch.einsum("ngk,ogk->nog", xg, wq) - ref).pow(2), rw)  # [rows, in/g]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max


def apply_clip(w: Tensor, max_val: Tensor, args: QuantArgs) -> Tensor:
    """w [out, in] clamped group-wise to [-max_val, max_val] (max_val [out, in/g]), in w's dtype."""
    out, cols = w.shape
    g = group_width(cols, args)
    wg = w.float().reshape(out, cols // g, g)  # [out, in/g, g]
    mv = max_val.float().unsqueeze(-1)  # [out, in/g, 1]
    return torch.clamp(wg, -mv, mv).reshape(out, cols).to(w.dtype)


def fake_quantize_clipped(w: Tensor, max_val: Tensor, args: QuantArgs) -> Tensor:
    """RTN fake quantization of w after clipping each group to [-max_val, max_val]."""
    return fake_quantize(apply_clip(w, max_val, args), args)
