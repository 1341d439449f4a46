"""`llmopt quantize`: source -> quantized artifact in the compressed-tensors layout."""
from __future__ import annotations

import torch

from ..calib import calibration_windows
from ..errors import ConfigError
from ..layerwise import check_patterns, decoder_layers, linear_names, name_matches, run_layerwise
from ..progress import StageHooks
from .config import QuantizeConfig
from .embeddings import EMBED, QuantizedEmbedding
from .methods import AWQ, GPTQ, LayerQuantizer, SmoothQuant
from .rtn import QuantArgs, resolve_group_size

ALWAYS_IGNORED = ("lm_head",)


QuantizeHooks = StageHooks


def plan_targets(model, config: QuantizeConfig) -> dict[int, dict[str, QuantArgs]]:
    """{layer index: {name inside layer: QuantArgs}}; refuses ignore patterns that match nothing."""
    names = linear_names(model)
    check_patterns(names, config.ignore)
    patterns = ALWAYS_IGNORED + tuple(config.ignore)
    prefixes = {f"model.layers.{i}.": i for i in range(len(decoder_layers(model)))}
    targets: dict[int, dict[str, QuantArgs]] = {}
    for name in names:
        if any(name_matches(name, p) for p in patterns):
            continue
        index = next((i for pre, i in prefixes.items() if name.startswith(pre)), None)
        if index is None:
            raise ConfigError(f"{name}: Linear outside the decoder layers; add --ignore {name}")
        linear = model.get_submodule(name)
        gs = -1 if config.scheme == "W8A8" else resolve_group_size(linear.in_features, config.group_size, layer=name)
        args = QuantArgs(bits=config.weight_bits, group_size=gs, symmetric=config.symmetric,
                         scale_dtype=linear.weight.dtype)
        targets.setdefault(index, {})[name[len(f"model.layers.{index}."):]] = args
    return targets


def check_not_quantized(model) -> None:
    qc = getattr(model.config, "quantization_config", None)
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", "?")
        raise ConfigError(f"the source is already quantized ({method}); quantize its unquantized parent instead")


def make_method(config: QuantizeConfig, targets, sink=None) -> LayerQuantizer:
    if config.method == "gptq":
        method = GPTQ(targets, config.damp, config.act_order, config.sink_share, config.observer)
    elif config.method == "awq":
        method = AWQ(targets, config.sink_share)
    elif config.method == "smoothquant":
        method = SmoothQuant(targets, config.smoothing_alpha)
    else:
        method = LayerQuantizer(targets, activations=config.scheme == "W8A8")
    method.sink = sink
    return method


def quantize_model(model, tokenizer, config: QuantizeConfig, hooks: QuantizeHooks,
                   sink=None) -> tuple[LayerQuantizer, list]:
    """Quantize `model` layer by layer; returns the method and per-layer reports.

    Without `sink` the dequantized weights stay in the model; with one, each finished layer's
    compressed tensors go to the sink and its weights are freed (see LayerQuantizer)."""
    targets = plan_targets(model, config)
    method = make_method(config, targets, sink)
    if config.method in ("gptq", "awq", "smoothquant"):
        hooks.status(f"calibration: {config.calib.nsamples} x {config.calib.seqlen} tokens of {config.calib.calib}")
        windows = calibration_windows(tokenizer, config.calib, model)
    else:
        windows = torch.zeros(1, 2, dtype=torch.long)  # RTN needs no data; one tiny pass drives the layers
    reports = run_layerwise(model, windows, method, device=config.device,
                            batch_size=config.batch_size, on_layer=hooks.layer)
    return method, reports


def rest_of_state(model, method: LayerQuantizer, embedding: QuantizedEmbedding | None = None) -> dict:
    """The tensors not written per layer: embeddings (compressed if quantized), norms, lm_head,
    unquantized Linears."""
    written = {f"{name}.{suffix}" for name in method.results for suffix in ("weight", "bias")}
    written |= embedding.replaces if embedding else set()  # a tied lm_head is the quantized embedding
    rest = {k: v for k, v in model.state_dict().items() if k not in written}
    return {**rest, **embedding.tensors} if embedding else rest


def quantization_config_of(model, method: LayerQuantizer, embedding: QuantizedEmbedding | None = None) -> dict:
    from ..compressed import LinearScheme, build_quantization_config

    schemes = {name: LinearScheme(r.args.bits, r.args.group_size, r.args.symmetric, r.activations)
               for name, r in method.results.items()}
    embeddings = {EMBED: embedding.scheme} if embedding else None
    return build_quantization_config(schemes, linear_names(model), embeddings)


def per_layer_table(method: LayerQuantizer, reports: list, embedding: QuantizedEmbedding | None = None) -> dict:
    """Manifest record: each quantized Linear's bits / group size, and each layer's error stats (and the
    quantized embedding's, if any)."""
    layers = {name: {"bits": r.args.bits, "group_size": r.args.group_size, "symmetric": r.args.symmetric,
                     "activations": "int8-per-token" if r.activations else None}
              for name, r in method.results.items()}
    table = {"linears": layers, "layers": [{"index": r.index, "seconds": round(r.seconds, 3), **r.stats}
                                           for r in reports]}
    return {**table, "embeddings": embedding.record()} if embedding else table
