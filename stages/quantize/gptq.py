"""GPTQ: quantize a Linear column by column, pushing each column's rounding error onto the
columns not yet quantized, weighted by the inverse Hessian of the layer's inputs.

Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers" (2022). Written from the paper: Cholesky form of the inverse Hessian, lazy batch
updates in blocks, optional act-order with static groups (so the stored layout needs no g_idx).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..errors import ConfigError
from ..layerwise import one_thread
from .rtn import QuantArgs, compute_qparams, dequantize, group_width, quantize


class HessianAccumulator:
    """Running H = 2/n * sum x x^T over the n input rows (tokens) seen so far, in float32."""

    def __init__(self, in_features: int, device: torch.device | str | None = None):
        self.in_features = in_features
        self.nsamples = 0
        self._h = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)

    def add(self, x: Tensor, weights: Tensor | None = None) -> None:
        """Add a batch of inputs x [..., in] (any float dtype); `weights` [...] (one per token,
        optional) scale each token's share of H (see `sink_token_weights`)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs with {self.in_features} features, got {tuple(x.shape)}")
        x = x.reshape(-1, self.in_features).to(self._h.device, torch.float32)  # [tokens, in]
        if weights is not None:
            x = x * weights.reshape(-1, 1).to(x.device, torch.float32).sqrt()
        n = x.shape[0]
        if n == 0:
            return
        # Running mean keeps the entries O(|x|^2) however many tokens are added.
        self._h *= self.nsamples / (self.nsamples + n)
        self.nsamples += n
        x = x * math.sqrt(2.0 / self.nsamples)
        self._h.addmm_(x.t(), x)

    @property
    def hessian(self) -> Tensor:
        """H [in, in] float32 (a live view: it keeps changing as inputs are added)."""
        return self._h


def sink_token_weights(hidden: Tensor, share: float, ratio: float = 5.0) -> Tensor | None:
    """Per-token Hessian weights [B, S] that give attention-sink tokens `share` of the total.

    Sinks are the tokens whose residual-stream norm (the decoder layer's input, [B, S, H]) is more
    than `ratio` times the batch median: the "massive activations" every later token attends to
    (position 0 in a window, sometimes a delimiter). They are a few tokens in thousands, so a plain
    mean Hessian ignores the directions their inputs take, and GPTQ's error compensation can wreck
    their keys and values (measured on smollm2-135m: 12-18x RTN's error on the sink's q/k/v while
    every other token's error fell 3-5x, and end-to-end perplexity worse than RTN). None when no
    token qualifies or share is 0.
    """
    if share <= 0:
        return None
    return sink_weights_from_norms(hidden.float().norm(dim=-1), share, ratio)  # [B, S]


def sink_weights_from_norms(norms: Tensor, share: float, ratio: float = 5.0) -> Tensor | None:
    """`sink_token_weights` from the tokens' residual-stream norms (any shape): weights of that shape."""
    if share <= 0:
        return None
    sinks = norms > ratio * norms.median()
    k = int(sinks.sum())
    if k == 0 or k == norms.numel():
        return None
    weights = torch.ones_like(norms)
    weights[sinks] = share / (1 - share) * (norms.numel() - k) / k
    return weights


@dataclass
class GPTQResult:
    q: Tensor  # int8 [out, in], codes in [qmin, qmax]
    scale: Tensor  # [out, in/g]
    zero_point: Tensor | None  # int8 [out, in/g], None when symmetric
    dequantized: Tensor  # [out, in] == rtn.dequantize(q, scale, zero_point)
    # Sum of the OBS losses (w - w')^2 / (2 d^2) over all weights, d^2 being the column's diagonal of
    # the inverse Hessian restricted to the columns not yet quantized (GPTQ's reported "error").
    error: float


def gptq_quantize(w: Tensor, hessian: Tensor, args: QuantArgs, damp: float = 0.01, block_size: int = 128,
                  act_order: bool = False, mask: Tensor | None = None, observer: str = "minmax") -> GPTQResult:
    """GPTQ-quantize w [out, in] given the input Hessian [in, in].

    mask [out, in] (bool, optional) marks weights that must stay exactly 0 (pruned): they are
    quantized to 0 and never receive error compensation. observer: how a group's range is chosen
    when the group starts (`compute_qparams`: "minmax" or "mse"), from the weights as already
    updated. Computed in float32 (float64 if w is).
    """
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    W = w.to(dtype).clone()
    H = hessian.to(W.device, dtype).clone()
    out, cols = W.shape
    g = group_width(cols, args)
    dead = torch.diagonal(H) == 0  # inputs never active: nothing to compensate with
    H[dead, dead] = 1
    W[:, dead] = 0
    keep = None if mask is None else ~mask.to(W.device)
    if keep is not None:
        W *= keep
    # Static qparams: per channel always; per group under act-order (groups then no longer
    # follow the column order, and static groups keep the stored layout free of g_idx).
    static = compute_qparams(W, args, observer) if (g == cols or act_order) else None
    perm = torch.argsort(torch.diagonal(H), descending=True) if act_order else None
    if perm is not None:
        W, H = W[:, perm], H[perm][:, perm]
        keep = None if keep is None else keep[:, perm]
    U = inverse_hessian_factor(H, damp)
    order = perm.tolist() if perm is not None else range(cols)
    group_of = [j // g for j in order]  # loop position -> original group (static qparams)
    with one_thread():
        q, losses, qparams = _quantize_blocks(W, U, args, g, block_size, static, group_of, keep, observer)
    if perm is not None:
        inv = torch.argsort(perm)
        q = q[:, inv]
    scale, zero = static if static is not None else qparams
    deq = dequantize(q, scale, zero, args)
    return GPTQResult(q=q, scale=scale, zero_point=zero, dequantized=deq, error=float(losses))


def inverse_hessian_factor(hessian: Tensor, damp: float, method: str = "GPTQ") -> Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1 (so H^-1 = U^T U); GPTQ and SparseGPT."""
    if not 0 < damp < 1:
        raise ConfigError(f"{method} dampening must lie in (0, 1) (got {damp})")
    H = hessian.clone()
    dead = torch.diagonal(H) == 0  # inputs never active: a unit diagonal keeps H invertible
    H[dead, dead] = 1
    diag = torch.arange(H.shape[0], device=H.device)
    H[diag, diag] += damp * torch.mean(torch.diagonal(H))
    L, info = torch.linalg.cholesky_ex(H)
    if info.item() != 0:
        raise ConfigError(f"the {method} Hessian is not positive definite even with dampening {damp}; "
                          "raise --damp or use more calibration samples")
    return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)


def _quantize_blocks(W: Tensor, U: Tensor, args: QuantArgs, g: int, block_size: int,
                     static: tuple | None, group_of: list[int], keep: Tensor | None, observer: str):
    """The GPTQ loop over blocks of columns; W is updated in place. Returns (q, loss, qparams)."""
    out, cols = W.shape
    if block_size < 1:
        raise ConfigError(f"GPTQ block size must be positive (got {block_size})")
    # A group must lie inside one block, so its qparams see all earlier columns' updates.
    block = max(g, (block_size // g) * g) if g < cols else block_size
    q = torch.zeros(out, cols, dtype=torch.int8, device=W.device)
    scales, zeros = [], []
    one = _single_group(args)  # one column (or one group) at a time
    loss = torch.zeros((), dtype=W.dtype, device=W.device)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]  # [out, b], [b, b]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            if static is None and (i1 + i) % g == 0:
                s, z = compute_qparams(W1[:, i:i + g], one, observer)
                scales.append(s), zeros.append(z)
            col_qp = _static_group(static, group_of[i1 + i]) if static is not None else (scales[-1], zeros[-1])
            q[:, i1 + i], deq = _quantize_column(W1[:, i], col_qp, one)
            d = U1[i, i]
            err = (W1[:, i] - deq) / d  # [out]
            loss += (err ** 2).sum() / 2  # OBS loss (w - w')^2 / d^2 / 2
            W1[:, i + 1:] -= err.unsqueeze(1) * U1[i, i + 1:].unsqueeze(0)
            if keep is not None:
                W1[:, i + 1:] *= keep[:, i1 + i + 1:i2]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]  # lazy batch update of the columns after the block
        if keep is not None:
            W[:, i2:] *= keep[:, i2:]
    qparams = (torch.cat(scales, 1), None if zeros[0] is None else torch.cat(zeros, 1)) if scales else None
    return q, loss.item(), qparams


def _single_group(args: QuantArgs) -> QuantArgs:
    return replace(args, group_size=-1)


def _static_group(static: tuple, group: int) -> tuple[Tensor, Tensor | None]:
    s, z = static
    return s[:, group:group + 1], None if z is None else z[:, group:group + 1]  # [out, 1]


def _quantize_column(col: Tensor, qparams: tuple, one: QuantArgs) -> tuple[Tensor, Tensor]:
    """Codes int8 [out] and dequantized values [out] of one column with its group's qparams."""
    s, z = qparams
    code = quantize(col.unsqueeze(1), s, z, one)  # [out, 1]
    return code.squeeze(1), dequantize(code, s, z, one).squeeze(1)
