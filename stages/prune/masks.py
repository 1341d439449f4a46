"""Which weights to zero: unstructured (a fraction of each row or of the whole matrix) or N:M
(N kept in every group of M consecutive inputs), by magnitude |W| or by Wanda's |W| * ||X_j||_2.

Masks are bool [out, in] with True marking a weight to prune. Sun et al., "A Simple and Effective
Pruning Approach for Large Language Models" (Wanda, 2023), written from the paper.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def prune_count(sparsity: float, n: int) -> int:
    """How many of `n` weights a `sparsity` prunes (floor, robust to 0.29 * 100 = 28.999...)."""
    return math.floor(sparsity * n + 1e-9)


def unstructured_mask(scores: Tensor, sparsity: float, per_row: bool) -> Tensor:
    """Prune the lowest scores: `sparsity` of each output row, or of the whole matrix."""
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if per_row:
        k = prune_count(sparsity, scores.shape[1])
        if k:
            mask.scatter_(1, scores.topk(k, dim=1, largest=False).indices, True)
        return mask
    k = prune_count(sparsity, scores.numel())
    if k:
        mask.view(-1)[scores.reshape(-1).topk(k, largest=False).indices] = True
    return mask


def nm_mask(scores: Tensor, n: int, m: int) -> Tensor:
    """Keep the `n` highest scores in every group of `m` consecutive inputs of each row."""
    out, cols = scores.shape
    groups = scores.reshape(out, cols // m, m)  # [out, groups, m]
    drop = groups.topk(m - n, dim=2, largest=False).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(2, drop, True)
    return mask.reshape(out, cols)


def select_mask(scores: Tensor, sparsity: float, nm: tuple[int, int] | None, per_row: bool) -> Tensor:
    """An N:M mask when `nm` is given, else an unstructured one at `sparsity`."""
    if nm is not None:
        return nm_mask(scores, *nm)
    return unstructured_mask(scores, sparsity, per_row)


def magnitude_mask(w: Tensor, sparsity: float, nm: tuple[int, int] | None) -> Tensor:
    """The usual magnitude baseline: the smallest |W| of the whole matrix (or of each N:M group)."""
    return select_mask(w.abs(), sparsity, nm, per_row=False)


def wanda_scores(w: Tensor, input_norm: Tensor) -> Tensor:
    """|W_ij| * ||X_j||_2: a weight matters as much as the input it multiplies. [out, in]"""
    return w.abs() * input_norm.to(w.dtype).unsqueeze(0)


def wanda_mask(w: Tensor, input_norm: Tensor, sparsity: float, nm: tuple[int, int] | None) -> Tensor:
    """Wanda compares weights within each output row (each row loses the same share)."""
    return select_mask(wanda_scores(w, input_norm), sparsity, nm, per_row=True)


class InputNorms:
    """Running sum of squares of each input feature over all tokens; `norm` is ||X_j||_2."""

    def __init__(self, in_features: int):
        self.sumsq = torch.zeros(in_features, dtype=torch.float64)
        self.tokens = 0

    def add(self, x: Tensor) -> None:
        flat = x.reshape(-1, x.shape[-1])  # [tokens, in]
        self.sumsq += flat.float().pow(2).sum(0).double().cpu()
        self.tokens += flat.shape[0]

    @property
    def norm(self) -> Tensor:
        return self.sumsq.sqrt().float()
