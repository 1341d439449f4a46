"""SparseGPT: prune a Linear column by column and let the weights not yet visited absorb each
pruned weight's error, weighted by the inverse Hessian of the layer's inputs (the OBS update).

Frantar & Alistarh, "SparseGPT: Massive Language Models Can Be Accurately Pruned in One-Shot"
(2023), written from the paper: the Cholesky factor U of H^-1 gives, row by row, the inverse
Hessian restricted to the columns not yet visited; the mask is chosen adaptively, per block of
columns (unstructured) or per group of M columns (N:M), from w^2 / U_ii^2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..layerwise import one_thread
from ..quantize.gptq import inverse_hessian_factor
from .masks import nm_mask, unstructured_mask


@dataclass
class SparseGPTResult:
    weight: Tensor  # [out, in], zeros where `mask`
    mask: Tensor  # bool [out, in], True = pruned
    loss: float  # sum of the OBS losses (w - w')^2 / (2 U_ii^2)


def sparsegpt_prune(w: Tensor, hessian: Tensor, sparsity: float, nm: tuple[int, int] | None = None,
                    damp: float = 0.01, block_size: int = 128) -> SparseGPTResult:
    """Prune w [out, in] to `sparsity` (or to N:M) given the input Hessian [in, in].

    Computed in float32 (float64 if w is); the result has w's dtype.
    """
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    W = w.to(dtype).clone()
    U = inverse_hessian_factor(hessian.to(W.device, dtype), damp, method="SparseGPT")
    m = nm[1] if nm else 1
    block = max(m, block_size // m * m)  # N:M groups never straddle two blocks
    mask = torch.zeros(W.shape, dtype=torch.bool, device=W.device)
    loss = 0.0
    with one_thread():
        for i1 in range(0, W.shape[1], block):
            i2 = min(i1 + block, W.shape[1])
            loss += _prune_block(W, U, mask, i1, i2, sparsity, nm)
    return SparseGPTResult(weight=W.to(w.dtype), mask=mask, loss=loss)


def _prune_block(W: Tensor, U: Tensor, mask: Tensor, i1: int, i2: int, sparsity: float,
                 nm: tuple[int, int] | None) -> float:
    """Prune columns [i1, i2) in place; push their error onto the later columns (lazy, per block)."""
    W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]  # [out, b], [b, b]
    d = torch.diagonal(U1)  # [b]
    M1 = mask[:, i1:i2]
    if nm is None:
        M1 |= unstructured_mask(W1.pow(2) / d.pow(2), sparsity, per_row=False)
    err = torch.zeros_like(W1)
    loss = 0.0
    for i in range(i2 - i1):
        if nm is not None and i % nm[1] == 0:
            g = slice(i, i + nm[1])
            M1[:, g] = nm_mask(W1[:, g].pow(2) / d[g].pow(2), *nm)
        col = W1[:, i]
        kept = col.masked_fill(M1[:, i], 0)
        e = (col - kept) / d[i]  # [out]
        loss += float(e.pow(2).sum()) / 2
        W1[:, i:] -= e.unsqueeze(1) * U1[i, i:].unsqueeze(0)
        W1[:, i] = kept  # exact zeros, not the update's rounding residue
        err[:, i] = e
    W[:, i1:i2] = W1
    W[:, i2:] -= err @ U[i1:i2, i2:]
    return loss
