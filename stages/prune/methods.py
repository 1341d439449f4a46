"""The layer methods that the shared layer-by-layer driver (`stages.layerwise`) runs for prune.

Each prunes one decoder layer after observing its Linears' inputs, and leaves the pruned weights
in the layer, so the next layer is calibrated on the outputs of the already pruned ones.
"""
from __future__ import annotations

import torch
from torch import nn

from ..families import Family
from ..quantize.gptq import HessianAccumulator
from .masks import InputNorms, magnitude_mask, wanda_mask
from .sparsegpt import sparsegpt_prune
from .structured import channel_importance, shrink_mlp, top_channels


def same_input(family: Family | None) -> dict[str, str]:
    """Linear -> the Linear whose identical input it observes instead: a family's q/k/v read one tensor, and
    gate/up another (fused in Phi-3: nothing to share). None (an architecture we do not describe): nothing."""
    if family is None:
        return {}
    out = {}
    for slot in ("qkv", "gate_up"):
        first, *rest = family.projections[slot]
        out.update({name: first for name in rest})
    return out


def _input_of(layer: nn.Module, name: str, same: dict[str, str]) -> str:
    other = same.get(name)
    try:
        return other if other and isinstance(layer.get_submodule(other), nn.Linear) else name
    except AttributeError:
        return name


class LayerPruner:
    """Unstructured or N:M pruning of the targeted Linears: magnitude, Wanda or SparseGPT.

    `targets` maps a layer index to the names (inside the layer) of the Linears to prune; `family` says which
    of them read one input (observed once).
    """

    def __init__(self, targets: dict[int, list[str]], method: str, sparsity: float,
                 nm: tuple[int, int] | None, damp: float = 0.01, device: str = "cpu", family: Family | None = None):
        self.targets, self.method, self.sparsity, self.nm = targets, method, sparsity, nm
        self.damp, self.device, self.same = damp, device, same_input(family)
        self.sparsity_by_linear: dict[str, float] = {}
        self._inputs: dict[str, object] = {}

    def observers(self, index: int, layer: nn.Module) -> dict:
        self._inputs = {}
        if self.method == "magnitude":
            return {}
        for name in self.targets.get(index, []):
            src = _input_of(layer, name, self.same)
            if src not in self._inputs:
                width = layer.get_submodule(src).in_features
                wanda = self.method == "wanda"
                self._inputs[src] = InputNorms(width) if wanda else HessianAccumulator(width, self.device)
        return {src: acc.add for src, acc in self._inputs.items()}

    def process(self, index: int, layer: nn.Module) -> dict:
        sparsity, losses = {}, {}
        for name in self.targets.get(index, []):
            linear = layer.get_submodule(name)
            w, loss = self._prune(linear.weight.data.float(), self._inputs.get(_input_of(layer, name, self.same)))
            linear.weight.data = w.to(linear.weight.dtype)  # a new tensor: the (mmap'd) source stays untouched
            sparsity[name] = float((linear.weight.data == 0).float().mean())
            self.sparsity_by_linear[f"model.layers.{index}.{name}"] = sparsity[name]
            if loss is not None:
                losses[name] = loss
        self._inputs = {}
        return {"sparsity": sparsity, **({"sparsegpt_loss": losses} if losses else {})}

    def _prune(self, w: torch.Tensor, observed) -> tuple[torch.Tensor, float | None]:
        if self.method == "magnitude":
            return w.masked_fill(magnitude_mask(w, self.sparsity, self.nm), 0), None
        if self.method == "wanda":
            return w.masked_fill(wanda_mask(w, observed.norm.to(w.device), self.sparsity, self.nm), 0), None
        res = sparsegpt_prune(w, observed.hessian, self.sparsity, self.nm, damp=self.damp)
        return res.weight, res.loss


class MlpChannelPruner:
    """Keeps the `keep` most important intermediate channels of every layer's MLP, removes the rest."""

    def __init__(self, keep: int, family: Family):
        self.keep, self.family = keep, family
        self.down = family.projections["down"][0]
        self._norms: InputNorms | None = None

    def observers(self, index: int, layer: nn.Module) -> dict:
        self._norms = InputNorms(layer.get_submodule(self.down).in_features)
        return {self.down: self._norms.add}

    def process(self, index: int, layer: nn.Module) -> dict:
        down = layer.get_submodule(self.down).weight.data
        importance = channel_importance(down, self._norms.norm).cpu()
        keep = top_channels(importance, self.keep)
        removed_share = 1 - float(importance[keep].sum() / importance.sum().clamp_min(1e-30))
        shrink_mlp(layer.mlp, keep.to(down.device), self.family)
        self._norms = None
        return {"kept_channels": self.keep, "removed_importance_share": round(removed_share, 6)}
