"""The compressed-tensors checkpoint format: writing our quantized Linears, reading them back.

Kept outside `quantize/` because every reader of an artifact (eval, serve) needs it, and the serve
engine must not import the quantize stage. Layout per quantized Linear `NAME`:
- pack-quantized (W4A16, W8A16): `NAME.weight_packed` int32 [out, in*b/32], `NAME.weight_scale`
  [out, in/g], `NAME.weight_shape` int64 [2], and `NAME.weight_zero_point` (packed over out) if asymmetric;
- int-quantized (W8A8): `NAME.weight` int8 [out, in], `NAME.weight_scale` [out, 1]; activations are
  quantized dynamically per token at run time.
A quantized Embedding (`--embeddings int8`) takes the pack-quantized layout of a Linear [vocab, hidden]
in a config group of its own; a tied lm_head has no tensors of its own and follows it.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch

from llmopt.kernels import dequantize

from .ctpack import pack_to_int32, pack_zero_point, unpack_from_int32, unpack_zero_point
from .errors import ArtifactError

PACKED, INT = "pack-quantized", "int-quantized"


@dataclass(frozen=True)
class LinearScheme:
    bits: int
    group_size: int  # -1: one group per output channel
    symmetric: bool
    activations: bool  # dynamic per-token int8 activations (W8A8)

    @property
    def format(self) -> str:
        return INT if self.activations else PACKED


def _weights_args(s: LinearScheme):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=s.bits, type="int", symmetric=s.symmetric, dynamic=False,
                            strategy="channel" if s.group_size == -1 else "group",
                            group_size=None if s.group_size == -1 else s.group_size)


def _targets(names: list[str], all_linears: list[str]) -> list[str]:
    """Suffix regexes where every Linear with that suffix is in this group, exact names otherwise."""
    targets, chosen = [], set(names)
    for suffix in sorted({n.rsplit(".", 1)[-1] for n in names}):
        with_suffix = [n for n in all_linears if n.rsplit(".", 1)[-1] == suffix]
        if all(n in chosen for n in with_suffix):
            targets.append(f"re:.*\\.{re.escape(suffix)}$")
        else:
            targets += [n for n in names if n.rsplit(".", 1)[-1] == suffix]
    return targets


def _config_group(targets: list[str], scheme: LinearScheme):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    act = None
    if scheme.activations:
        act = QuantizationArgs(num_bits=8, type="int", symmetric=True, dynamic=True, strategy="token")
    return QuantizationScheme(targets=targets, weights=_weights_args(scheme), input_activations=act,
                              format=scheme.format)


def build_quantization_config(schemes: dict[str, LinearScheme], all_linears: list[str],
                              embeddings: dict[str, LinearScheme] | None = None) -> dict:
    """config.json `quantization_config` for the given per-Linear schemes, and per-Embedding ones
    (`--embeddings int8`: a group of its own, targeted by the module's name): compressed-tensors' own
    QuantizationConfig, dumped as its ModelCompressor writes it."""
    from compressed_tensors.quantization import QuantizationConfig

    groups: dict[LinearScheme, list[str]] = defaultdict(list)
    for name, scheme in schemes.items():
        groups[scheme].append(name)
    config_groups = {f"group_{i}": _config_group(_targets(names, all_linears), scheme)
                     for i, (scheme, names) in enumerate(sorted(groups.items(), key=lambda kv: -len(kv[1])))}
    for name, scheme in (embeddings or {}).items():
        leaf = re.escape(name.rsplit(".", 1)[-1])
        config_groups[f"group_{len(config_groups)}"] = _config_group([f"re:.*{leaf}$"], scheme)
    formats = {s.format for s in groups} | {s.format for s in (embeddings or {}).values()}
    config = QuantizationConfig(config_groups=config_groups, quantization_status="compressed",
                                format=formats.pop() if len(formats) == 1 else "mixed-precision",
                                ignore=sorted(n for n in all_linears if n not in schemes))
    # the keys ModelCompressor.update_config adds beside the quantization config
    return {**config.model_dump(mode="json"), "sparsity_config": {}, "transform_config": {}}


def compress_linear(name: str, q: torch.Tensor, scale: torch.Tensor, zero_point, scheme: LinearScheme,
                    dtype: torch.dtype = torch.float32) -> dict:
    """State-dict entries for one quantized Linear (q: signed int8 codes [out, in]; scale stored as dtype)."""
    if scheme.activations:
        return {f"{name}.weight": q.to(torch.int8).contiguous(), f"{name}.weight_scale": scale.to(dtype).contiguous()}
    out = {f"{name}.weight_packed": pack_to_int32(q, scheme.bits),
           f"{name}.weight_scale": scale.to(dtype).contiguous(),
           f"{name}.weight_shape": torch.tensor(list(q.shape), dtype=torch.int64)}
    if zero_point is not None:
        out[f"{name}.weight_zero_point"] = pack_zero_point(zero_point.to(torch.int8), scheme.bits)
    return out


# ---- reading ---------------------------------------------------------------------------------

def _match(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target


def parse_schemes(qconfig: dict, linear_names: list[str], embedding_names: list[str] = ()) -> dict[str, LinearScheme]:
    """Which Linear (and Embedding) gets which scheme, from a compressed-tensors quantization_config.
    A class target ("Linear", "Embedding") applies to the modules of that kind only."""
    if qconfig.get("quant_method") != "compressed-tensors":
        raise ArtifactError(f"quantization method {qconfig.get('quant_method')!r} is not compressed-tensors")
    ignore = qconfig.get("ignore") or []
    schemes = {}
    for group in qconfig.get("config_groups", {}).values():
        w, act = group.get("weights") or {}, group.get("input_activations")
        if w.get("type", "int") != "int":
            raise ArtifactError(f"compressed-tensors weights of type {w.get('type')} are not supported (int only)")
        scheme = LinearScheme(int(w["num_bits"]), int(w.get("group_size") or -1), bool(w.get("symmetric", True)),
                              act is not None)
        kinds = [(n, "Linear") for n in linear_names] + [(n, "Embedding") for n in embedding_names]
        for name, kind in kinds:
            if any(_match(name, i) for i in ignore):
                continue
            if kind in group["targets"] or any(_match(name, t) for t in group["targets"]):
                schemes[name] = scheme
    return schemes


def decompress_linear(state: dict, name: str, scheme: LinearScheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(signed int8 codes [out, in], scale, zero point or None) of one Linear, from the state dict."""
    try:
        if scheme.activations:
            return state[f"{name}.weight"].to(torch.int8), state[f"{name}.weight_scale"], None
        out, inp = (int(v) for v in state[f"{name}.weight_shape"].tolist())
        q = unpack_from_int32(state[f"{name}.weight_packed"], scheme.bits, (out, inp))
        zp_key = f"{name}.weight_zero_point"
        zp = unpack_zero_point(state[zp_key], scheme.bits, out) if zp_key in state else None
        return q, state[f"{name}.weight_scale"], zp
    except KeyError as e:
        raise ArtifactError(f"quantized weights of {name} lack {e.args[0]}") from None


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, zero_point, dtype: torch.dtype) -> torch.Tensor:
    """Dense weight [out, in] = (q - zero) * scale computed in fp32 (`llmopt.kernels.dequantize`, group width
    inferred from the scale's shape), then cast to `dtype`."""
    return dequantize(q, scale, zero_point).to(dtype)


def materialize(model, state: dict, qconfig: dict, dtype: torch.dtype) -> dict:
    """Prepare a meta-built `model` and its compressed `state` for `load_state_dict(assign=True)`.

    Weight-only Linears and quantized Embeddings become dense weights (exactly `(q - zero) * scale`,
    the numbers the quantizer evaluated); W8A8 Linears become runtime modules that quantize
    activations per token.
    """
    from torch import nn

    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    embeddings = [n for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    schemes = parse_schemes(qconfig, linears, embeddings)  # a quantized Embedding: dense again, a tied lm_head with it
    state = dict(state)
    for name, scheme in schemes.items():
        q, scale, zp = decompress_linear(state, name, scheme)
        for suffix in ("weight", "weight_packed", "weight_scale", "weight_shape", "weight_zero_point"):
            state.pop(f"{name}.{suffix}", None)
        if scheme.activations:
            _swap_w8a8(model, name, q, scale, state.pop(f"{name}.bias", None))
        else:
            state[f"{name}.weight"] = dequantize_codes(q, scale, zp, dtype)
    return state


def _swap_w8a8(model, name: str, q, scale, bias) -> None:
    from llmopt.kernels import select_backend

    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    # The eval path runs on CPU; W8A8 takes fbgemm on both CPU backends, so the native library is not needed.
    layer = select_backend("cpu-torch").quantized_linear("w8a8", {"weight": q.contiguous(), "weight_scale": scale.float()},
                                                         bias=bias)
    setattr(parent, child, layer)
