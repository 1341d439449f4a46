"""`llmopt prune` on a loaded model: plan and check the work, then prune through the shared
layer-by-layer driver (or, for layer dropping, one measuring pass) and describe what was done."""
from __future__ import annotations

import torch
from torch import nn

from ..calib import calibration_windows
from ..errors import ConfigError
from ..families import Family, family_of
from ..layerwise import check_patterns, decoder_layers, linear_names, name_matches, run_layerwise
from ..progress import StageHooks
from .config import PruneConfig
from .methods import LayerPruner, MlpChannelPruner
from .structured import angular_distances, channels_to_keep, drop_layers, intermediate_size, layers_to_drop


PruneHooks = StageHooks


def model_family(model) -> Family | None:
    """The model's Family (stages/families.py), None for an architecture it does not describe."""
    try:
        return family_of(model.config.to_dict())
    except ConfigError:
        return None


def mlp_family(model) -> Family:
    """The Family --structured mlp shrinks the layers of; refuses an architecture we do not describe."""
    family = model_family(model)
    if family is None:
        arch = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
        raise ConfigError(f"--structured mlp: stages/families.py does not describe {arch}'s MLP; prune it "
                          "unstructured (--method wanda) or drop layers (--structured layers)")
    return family


def check_dense(model) -> None:
    if getattr(model.config, "quantization_config", None) is not None:
        raise ConfigError("the source is quantized; prune its unquantized parent, then quantize the pruned model")


def plan_targets(model, config: PruneConfig) -> dict[int, list[str]]:
    """{layer index: [Linear names inside the layer]}: every decoder-layer Linear not ignored.
    Embeddings and lm_head sit outside the layers and are never pruned."""
    check_patterns(linear_names(model), config.ignore)  # the same pattern language as quantize --ignore
    targets: dict[int, list[str]] = {}
    for index, layer in enumerate(decoder_layers(model)):
        for name, module in layer.named_modules():
            full = f"model.layers.{index}.{name}"
            if isinstance(module, nn.Linear) and not any(name_matches(full, p) for p in config.ignore):
                _check_groups(full, module, config)
                targets.setdefault(index, []).append(name)
    return targets


def _check_groups(full: str, linear: nn.Linear, config: PruneConfig) -> None:
    if config.nm and linear.in_features % config.nm[1]:
        raise ConfigError(f"--pattern {config.pattern}: {config.nm[1]} does not divide the input size "
                          f"{linear.in_features} of {full}; add --ignore {full}")


def check_plan(model, config: PruneConfig) -> None:
    """Every model-dependent check, before any calibration or evaluation work."""
    check_dense(model)
    if config.structured == "mlp":
        channels_to_keep(intermediate_size(model, mlp_family(model)), config.ratio)
    elif config.structured == "layers":
        layers_to_drop([0.0] * len(decoder_layers(model)), config.drop)
    else:
        plan_targets(model, config)


def prune_model(model, tokenizer, config: PruneConfig, hooks: PruneHooks) -> dict:
    """Prune `model` in place; returns the manifest metrics that describe the result."""
    check_plan(model, config)
    windows = _windows(model, tokenizer, config, hooks)
    if config.structured == "mlp":
        return _prune_mlp(model, windows, config, hooks)
    if config.structured == "layers":
        return _drop_layers(model, windows, config, hooks)
    return _prune_weights(model, windows, config, hooks)


def _windows(model, tokenizer, config: PruneConfig, hooks: PruneHooks) -> torch.Tensor:
    if not config.needs_calibration:
        return torch.zeros(1, 2, dtype=torch.long)  # magnitude needs no data; one tiny pass drives the layers
    c = config.calib
    hooks.status(f"calibration: {c.nsamples} x {c.seqlen} tokens of {c.calib}")
    return calibration_windows(tokenizer, c, model)


def _run(model, windows, method, config: PruneConfig, hooks: PruneHooks) -> list:
    return run_layerwise(model, windows, method, device=config.device, batch_size=config.batch_size,
                         on_layer=hooks.layer)


def _prune_weights(model, windows, config: PruneConfig, hooks: PruneHooks) -> dict:
    targets = plan_targets(model, config)
    method = LayerPruner(targets, config.method_name, config.target_sparsity, config.nm, config.damp, config.device,
                         model_family(model))
    reports = _run(model, windows, method, config, hooks)
    sizes = {name: model.get_submodule(name).weight.numel() for name in method.sparsity_by_linear}
    zeros = sum(method.sparsity_by_linear[n] * sizes[n] for n in sizes)
    layers = [{"index": r.index, "seconds": round(r.seconds, 3), **r.stats} for r in reports]
    return {"sparsity": {"method": config.method_name, "pattern": config.pattern, "target": config.target_sparsity,
                         "overall": zeros / max(1, sum(sizes.values())), "linears": method.sparsity_by_linear,
                         "layers": layers}}


def _prune_mlp(model, windows, config: PruneConfig, hooks: PruneHooks) -> dict:
    family = mlp_family(model)
    before = intermediate_size(model, family)
    keep = channels_to_keep(before, config.ratio)
    reports = _run(model, windows, MlpChannelPruner(keep, family), config, hooks)
    model.config.intermediate_size = keep
    return {"structured": {"kind": "mlp", "ratio": config.ratio, "intermediate_size_before": before,
                           "intermediate_size": keep,
                           "layers": [{"index": r.index, "seconds": round(r.seconds, 3), **r.stats} for r in reports]}}


def _drop_layers(model, windows, config: PruneConfig, hooks: PruneHooks) -> dict:
    before = len(decoder_layers(model))
    hooks.status(f"angular distance of each of {before} layers on the calibration data")
    distances = angular_distances(model, windows, config.batch_size, config.device)
    drop = layers_to_drop(distances, config.drop)
    drop_layers(model, drop)
    return {"structured": {"kind": "layers", "dropped_layers": drop, "num_hidden_layers_before": before,
                           "num_hidden_layers": before - len(drop),
                           "angular_distance": [round(d, 6) for d in distances]}}
