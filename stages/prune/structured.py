"""Structured pruning: remove whole MLP channels or whole decoder layers, so the written model is
genuinely smaller (and faster on any runtime), not just full of zeros.

MLP channels: channel j of a gated MLP is row j of gate_proj and up_proj (rows j and I + j of Phi-3's
fused gate_up_proj, gate || up) and column j of down_proj; its importance is
||down_proj[:, j]||_2 * ||h_j||_2 over the calibration tokens (h the input of down_proj), a bound on
what the channel adds to the layer's output. Layers: the angular distance arccos(cos(x, f(x))) / pi
between a layer's input and output, averaged over calibration tokens (Gromov et al. 2024; the "block
influence" of Men et al. 2024 is 1 - cos): layers that change their input least go first.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from ..families import FAMILIES, Family
from ..layerwise import decoder_layers


def mlp_linears(family: Family) -> tuple[str, ...]:
    """The MLP's Linears under model.layers.{i}: gate and up (or Phi-3's fused gate_up_proj), then down."""
    return family.projections["gate_up"] + family.projections["down"]


def intermediate_size(model, family: Family) -> int:
    """The MLP width shared by every layer (the only layout a Hugging Face config can describe)."""
    sizes, names = set(), mlp_linears(family)
    for i, layer in enumerate(decoder_layers(model)):
        if not all(isinstance(_submodule(layer, n), nn.Linear) for n in names):
            raise ConfigError(f"layer {i} has no gated MLP ({', '.join(names)}) as a {family.name} layer has; "
                              "prune it unstructured (--method wanda) or drop layers (--structured layers)")
        sizes.add(layer.get_submodule(family.projections["down"][0]).in_features)
    if len(sizes) != 1:
        raise ConfigError(f"the MLP widths differ between layers ({sorted(sizes)}); --structured mlp needs one width")
    return sizes.pop()


def channels_to_keep(width: int, ratio: float) -> int:
    """How many of `width` channels survive removing `ratio` of them; refuses none or all."""
    removed = round(ratio * width)
    if removed >= width:
        raise ConfigError(f"--ratio {ratio:g} removes all {width} MLP channels; choose a smaller ratio")
    if removed == 0:
        raise ConfigError(f"--ratio {ratio:g} removes no channel of {width}; choose a larger ratio")
    return width - removed


def channel_importance(down_weight: Tensor, input_norm: Tensor) -> Tensor:
    """||down_proj[:, j]||_2 * ||h_j||_2 for each intermediate channel j. [intermediate]"""
    return down_weight.float().norm(dim=0) * input_norm.float()


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def _take(linear: nn.Linear, dim: int, index: Tensor) -> nn.Linear:
    """A new Linear holding only the rows (dim 0) or columns (dim 1) in `index`."""
    w = linear.weight.data.index_select(dim, index).clone()
    new = nn.Linear(w.shape[1], w.shape[0], bias=linear.bias is not None, device="meta", dtype=w.dtype)
    new.weight = nn.Parameter(w, requires_grad=False)
    if linear.bias is not None:  # a row's bias goes with it; down_proj's bias stays whole
        bias = linear.bias.data.index_select(0, index) if dim == 0 else linear.bias.data
        new.bias = nn.Parameter(bias.clone(), requires_grad=False)
    return new


def shrink_mlp(mlp: nn.Module, keep: Tensor, family: Family = FAMILIES[0]) -> None:
    """Keep only the channels `keep` (sorted indices) of a layer's gated MLP (its `mlp` module, laid out as
    `family` says: Llama's by default), in place: their gate and up rows and their down columns."""
    (down,) = (n.removeprefix("mlp.") for n in family.projections["down"])
    width = getattr(mlp, down).in_features
    for name in family.projections["gate_up"]:
        name = name.removeprefix("mlp.")
        halves = len(family.sections()[f"mlp.{name}"])  # 2 in a fused gate_up_proj: gate rows, then up rows
        rows = torch.cat([keep + h * width for h in range(halves)])
        setattr(mlp, name, _take(getattr(mlp, name), 0, rows))
    setattr(mlp, down, _take(getattr(mlp, down), 1, keep))
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = keep.numel()


def top_channels(importance: Tensor, keep: int) -> Tensor:
    """Indices of the `keep` most important channels, in their original order."""
    return importance.topk(keep).indices.sort().values


@torch.inference_mode()
def angular_distances(model, windows: Tensor, batch_size: int, device: str = "cpu") -> list[float]:
    """Mean angular distance between each decoder layer's input and output on `windows` [n, S]."""
    layers = decoder_layers(model)
    sums = [0.0] * len(layers)

    def hook(index):
        def record(module, args, kwargs, output):
            x = args[0] if args else kwargs["hidden_states"]
            y = output[0] if isinstance(output, tuple) else output
            cos = F.cosine_similarity(x.float(), y.float(), dim=-1).clamp(-1, 1)  # [b, S]
            sums[index] += float(torch.arccos(cos).sum()) / math.pi
        return record

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    model.to(device)
    try:
        for i in range(0, len(windows), batch_size):
            model.model(input_ids=windows[i:i + batch_size].to(device), use_cache=False)  # no lm_head: logits unused
    finally:
        for h in handles:
            h.remove()
        model.to("cpu")
    return [s / windows.numel() for s in sums]


def layers_to_drop(distances: list[float], drop: int) -> list[int]:
    """The `drop` layers with the smallest distance, as sorted indices."""
    if not 1 <= drop < len(distances):
        raise ConfigError(f"--drop {drop}: the model has {len(distances)} layers; "
                          f"drop between 1 and {len(distances) - 1}")
    return sorted(sorted(range(len(distances)), key=lambda i: distances[i])[:drop])


def drop_layers(model, drop: list[int]) -> None:
    """Remove decoder layers `drop` in place; renumber the rest and update the config."""
    kept = [layer for i, layer in enumerate(decoder_layers(model)) if i not in drop]
    for new_index, layer in enumerate(kept):
        for module in (layer, getattr(layer, "self_attn", None)):
            if module is not None and hasattr(module, "layer_idx"):  # the KV cache is indexed by it
                module.layer_idx = new_index
    model.model.layers = nn.ModuleList(kept)
    config = model.config
    if getattr(config, "layer_types", None):
        config.layer_types = [t for i, t in enumerate(config.layer_types) if i not in drop]
    config.num_hidden_layers = len(kept)
