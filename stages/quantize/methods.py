"""The layer methods (RTN, GPTQ, AWQ, SmoothQuant) that the layer-by-layer driver runs.

Each method quantizes the targeted Linears of one decoder layer, records the integer tensors for
export in `results`, and leaves the dequantized weights in the layer so that the next layer is
calibrated on the outputs of the already quantized one. Which Linears share an input, and where a scale
on that input folds (AWQ, SmoothQuant), comes from the model's Family (stages/families.py): a norm (Gemma's
(1 + w) included), or the up rows of the MLP (Phi-3: the second half of the fused gate_up_proj).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..compressed import LinearScheme, compress_linear
from ..errors import ConfigError
from ..families import Family, family_of
from .awq import apply_clip, awq_search_clip, awq_search_scale
from .fold import apply_scale_to_linears, apply_scale_to_norm, apply_scale_to_prev_linear
from .gptq import HessianAccumulator, gptq_quantize, sink_token_weights, sink_weights_from_norms
from .rtn import QuantArgs, compute_qparams, dequantize, quantize
from .smoothquant import smooth_scales

# AWQ leaves the query and key rows unclipped: their errors pass through softmax, where the output MSE misleads.
NO_CLIP = ("q", "k")


@dataclass(frozen=True)
class Fold:
    """Linears that read one input (`consumers`) and what produces that input, where a scale on it folds:
    a norm's weight, or the output rows of a `section` of a Linear (the MLP's up rows feed down_proj)."""

    consumers: tuple[str, ...]
    norm: str | None = None
    section: str | None = None


def family_folds(family: Family) -> tuple[Fold, ...]:
    """A family's groups of Linears that read one input, with where a scale on each input folds. Every family
    folds all three (`apply_fold` handles Gemma's (1 + w) norms and Phi-3's fused up rows), which
    `Family.shared_inputs` leaves out."""
    p = family.projections
    return (Fold(p["qkv"], norm=family.norms["input"]), Fold(p["gate_up"], norm=family.norms["mlp"]),
            Fold(p["down"], section="up"))


def layer_family(layer: nn.Module) -> Family | None:
    """The Family of a transformers decoder layer (from its attention's config); None for an architecture
    stages/families.py does not describe."""
    config = getattr(getattr(layer, "self_attn", None), "config", None) or getattr(layer, "config", None)
    if config is None:
        return None
    try:
        return family_of(config.to_dict())
    except ConfigError:
        return None


def layer_rows(family: Family, layer: nn.Module) -> dict[str, tuple[str, int, int]]:
    """Each section (q, k, v, o, gate, up, down) -> (the Linear holding it, first row, end row), sized from
    the layer's own modules (a pruned MLP is narrower than its config says)."""
    p = family.projections
    o_proj = layer.get_submodule(p["o_proj"][0])
    q_size = o_proj.in_features
    qkv_rows = sum(layer.get_submodule(n).out_features for n in p["qkv"])
    inter = layer.get_submodule(p["down"][0]).in_features
    return family.section_rows(o_proj.out_features, q_size, (qkv_rows - q_size) // 2, inter)


def with_rows(w: torch.Tensor, start: int, end: int, rows: torch.Tensor) -> torch.Tensor:
    """w with its rows [start, end) replaced by `rows` (a new tensor; w itself may be a mapped file)."""
    if start == 0 and end == w.shape[0]:
        return rows
    out = w.clone()
    out[start:end] = rows
    return out


def apply_fold(layer: nn.Module, family: Family, fold: Fold, s: torch.Tensor) -> None:
    """Divide the input of `fold`'s Linears by s [in] where it is produced and multiply their weights by s, in
    place: the layer computes what it did, and the Linears' weights are what gets quantized."""
    if fold.norm is not None:
        norm, offset = layer.get_submodule(fold.norm), family.norm_offset
        w = norm.weight.data  # Gemma stores w - 1 and scales by (1 + w): s divides the (1 + w)
        scaled, _ = apply_scale_to_norm(w.float() + offset, s)
        norm.weight.data = (scaled - offset).to(w.dtype)
    else:  # the rows of one section of a Linear (Phi-3: the up half of the fused gate_up_proj)
        name, start, end = layer_rows(family, layer)[fold.section]
        prev = layer.get_submodule(name)
        bias = None if prev.bias is None else prev.bias.data[start:end]
        rows, bias = apply_scale_to_prev_linear(prev.weight.data[start:end], s, bias)
        prev.weight.data = with_rows(prev.weight.data, start, end, rows)
        if bias is not None:
            prev.bias.data = with_rows(prev.bias.data, start, end, bias)
    linears = [layer.get_submodule(n) for n in fold.consumers]
    for linear, w in zip(linears, apply_scale_to_linears([m.weight.data for m in linears], s)):
        linear.weight.data = w


def clip_rows(rows: dict[str, tuple[str, int, int]]) -> dict[str, list[tuple[int, int]]]:
    """Each Linear's output rows that AWQ clips, as runs [start, end): every section's but NO_CLIP's (Phi-3's
    fused qkv_proj: its v rows only)."""
    runs: dict[str, list[tuple[int, int]]] = {}
    for section, (name, start, end) in rows.items():
        if section in NO_CLIP:
            continue
        own = runs.setdefault(name, [])
        if own and own[-1][1] == start:
            own[-1] = (own[-1][0], end)
        else:
            own.append((start, end))
    return runs


@dataclass
class QuantizedLinear:
    """What export needs for one Linear: integer weights and their parameters."""

    q: torch.Tensor  # int8 [out, in], signed grid
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    args: QuantArgs
    activations: bool = False  # W8A8: dynamic per-token int8 inputs at run time


class LayerQuantizer:
    """Base: `targets` maps a layer index to {name inside the layer: QuantArgs}.

    With a `sink` (a callable taking a dict of compressed tensors), each finished layer is packed,
    handed to the sink and its weights freed, so memory holds about one layer at a time; without one
    the dequantized weights stay in the model and the codes in `results` (small models, tests).
    `family` (stages/families.py) names the layer's tensors; None: read from the first layer's config.
    """

    family: Family | None = None

    def __init__(self, targets: dict[int, dict[str, QuantArgs]], activations: bool = False, sink=None):
        self.targets = targets
        self.activations = activations
        self.sink = sink
        self.results: dict[str, QuantizedLinear] = {}

    def folds(self, layer: nn.Module) -> tuple[Fold, ...]:
        """The layer's groups of Linears that share an input (none for an architecture we do not describe:
        each Linear then observes its own input)."""
        if self.family is None:
            self.family = layer_family(layer)
        return () if self.family is None else family_folds(self.family)

    def observers(self, index: int, layer: nn.Module) -> dict:
        return {}

    def finish(self, index: int, layer: nn.Module) -> None:
        if self.sink is None:
            return
        tensors = {}
        for name in self.targets.get(index, {}):
            full = f"model.layers.{index}.{name}"
            res, linear = self.results[full], layer.get_submodule(name)
            scheme = LinearScheme(res.args.bits, res.args.group_size, res.args.symmetric, res.activations)
            tensors.update(compress_linear(full, res.q, res.scale, res.zero_point, scheme, linear.weight.dtype))
            if linear.bias is not None:
                tensors[f"{full}.bias"] = linear.bias.data
            res.q = res.scale = res.zero_point = None  # written: drop codes and dense weights
            linear.weight = nn.Parameter(torch.empty(0, dtype=linear.weight.dtype), requires_grad=False)
        self.sink(tensors)

    def _store(self, index: int, name: str, linear: nn.Linear, q, scale, zp, args) -> float:
        w = linear.weight.data
        deq = dequantize(q, scale, zp, args).to(w.dtype)
        err = ((deq.float() - w.float()).norm() / w.float().norm().clamp_min(1e-12)).item()
        linear.weight.data = deq
        self.results[f"model.layers.{index}.{name}"] = QuantizedLinear(q, scale, zp, args, self.activations)
        return err

    def _rtn(self, index: int, layer: nn.Module) -> dict:
        errors = {}
        for name, args in self.targets.get(index, {}).items():
            linear = layer.get_submodule(name)
            w = linear.weight.data.float()
            mask = w == 0
            scale, zp = compute_qparams(w, args)
            q = quantize(w, scale, zp, args)
            errors[name] = self._store(index, name, linear, _keep_zeros(q, zp, mask, args), scale, zp, args)
        return {"rel_weight_error": errors}

    def process(self, index: int, layer: nn.Module) -> dict:
        return self._rtn(index, layer)


def _keep_zeros(q, zp, mask, args):
    """Weights that are exactly zero (pruned) map to the grid's zero."""
    if not mask.any():
        return q
    if zp is None:
        return q.masked_fill(mask, 0)
    g = q.shape[1] if args.group_size == -1 else args.group_size
    zero = zp.repeat_interleave(g, dim=1).to(q.dtype)
    return torch.where(mask, zero, q)


class GPTQ(LayerQuantizer):
    """GPTQ per Linear, on Hessians shared by the Linears that read one input. The settings come from
    QuantizeConfig (damp, act_order, sink_share, observer), which holds their defaults."""

    def __init__(self, targets, damp: float, act_order: bool, sink_share: float, observer: str):
        super().__init__(targets)
        self.damp, self.act_order, self.sink_share, self.observer = damp, act_order, sink_share, observer
        self.hessians: dict[str, HessianAccumulator] = {}
        self._weights = None  # per-token Hessian weights of the batch now running through the layer

    def observers(self, index, layer):
        targets = self.targets.get(index, {})
        self.hessians, hooks = {}, {}
        for fold in self.folds(layer):  # linears that read one input share one Hessian (q/k/v, gate/up)
            names = fold.consumers
            if len(names) > 1 and all(n in targets for n in names):
                acc = HessianAccumulator(layer.get_submodule(names[0]).in_features)
                self.hessians.update({n: acc for n in names})
                hooks[names[0]] = self._adder(acc)
        for name in targets:
            if name not in self.hessians:
                self.hessians[name] = HessianAccumulator(layer.get_submodule(name).in_features)
                hooks[name] = self._adder(self.hessians[name])
        # "" is the decoder layer itself: its pre-hook sees the residual stream before the linears run.
        return {"": self._weigh_tokens, **hooks}

    def _weigh_tokens(self, hidden):
        self._weights = sink_token_weights(hidden, self.sink_share)

    def _adder(self, acc: HessianAccumulator):
        return lambda x: acc.add(x, self._weights)

    def process(self, index, layer):
        errors = {}
        for name, args in self.targets.get(index, {}).items():
            linear = layer.get_submodule(name)
            w = linear.weight.data.float()
            mask = w == 0
            res = gptq_quantize(w, self.hessians[name].hessian, args, damp=self.damp,
                                act_order=self.act_order, mask=mask if mask.any() else None, observer=self.observer)
            self._store(index, name, linear, res.q, res.scale, res.zero_point, args)
            errors[name] = res.error
        self.hessians = {}
        return {"gptq_loss": errors}


class ActivationSampler:
    """A bounded, deterministic sample of input rows [n, in] for scale searches, spread evenly
    over every batch seen: rows whose running index is a multiple of `stride` are kept, and when
    more than `max_rows` are held the stride doubles and every other kept row goes. With each row
    it keeps its token's residual-stream norm when one is given (see `AWQ`: attention sinks)."""

    def __init__(self, max_rows: int = 4096):
        self.max_rows = max_rows
        self.absmax: torch.Tensor | None = None
        self.stride, self.seen = 1, 0
        self._index, self._rows, self._norms = [], [], []

    def add(self, x: torch.Tensor, norms: torch.Tensor | None = None) -> None:
        flat = x.reshape(-1, x.shape[-1]).float()  # [B*S, in]
        amax = flat.abs().amax(0)
        self.absmax = amax if self.absmax is None else torch.maximum(self.absmax, amax)
        index = torch.arange(self.seen, self.seen + flat.shape[0])
        self.seen += flat.shape[0]
        keep = index % self.stride == 0
        self._index.append(index[keep])
        self._rows.append(flat[keep])
        self._norms.append(None if norms is None else norms.reshape(-1).float().cpu()[keep])
        while sum(len(i) for i in self._index) > self.max_rows:
            self.stride *= 2
            kept = [i % self.stride == 0 for i in self._index]
            self._index = [i[k] for i, k in zip(self._index, kept)]
            self._rows = [r[k.to(r.device)] for r, k in zip(self._rows, kept)]
            self._norms = [None if n is None else n[k] for n, k in zip(self._norms, kept)]

    def sample(self) -> torch.Tensor:
        return torch.cat(self._rows)

    def norms(self) -> torch.Tensor | None:
        """The kept rows' token norms [n], or None unless every batch came with them."""
        if not self._norms or any(n is None for n in self._norms):
            return None
        return torch.cat(self._norms)


class _Smoothing(LayerQuantizer):
    """Shared: observe each shared-input group's input; subclasses choose the scale.

    The decoder layer's pre-hook ("") records each token's residual-stream norm, and every sampled
    input row keeps its token's norm, so a subclass can tell attention-sink tokens apart."""

    _token_norms = None  # [B*S] norms of the batch now running through the layer
    instead = "gptq or rtn"  # what to use where the scales cannot fold

    def folds(self, layer):
        folds = super().folds(layer)
        if not folds:
            raise ConfigError(f"--method {type(self).__name__.lower()}: stages/families.py does not describe "
                              f"{type(layer).__name__}, so its input scales cannot be folded; "
                              f"use --method {self.instead}")
        return folds

    def observers(self, index, layer):
        self.samplers = {}
        for fold in self.folds(layer):
            if all(n in self.targets.get(index, {}) for n in fold.consumers):
                self.samplers[fold.consumers[0]] = ActivationSampler()
        hooks = {name: self._adder(s) for name, s in self.samplers.items()}
        return {"": self._note_norms, **hooks} if hooks else hooks

    def _note_norms(self, hidden):
        self._token_norms = hidden.float().norm(dim=-1).reshape(-1)

    def _adder(self, sampler: ActivationSampler):
        return lambda x: sampler.add(x, self._token_norms)

    def _smooth_layer(self, index, layer) -> dict:
        scales, self.applied = {}, {}
        for fold in self.folds(layer):
            names = fold.consumers
            sampler = self.samplers.get(names[0])
            if sampler is None:
                continue
            s = self.scale_for(sampler, [layer.get_submodule(n).weight.data.float() for n in names], names)
            apply_fold(layer, self.family, fold, s.float())
            scales[names[0]] = float(s.max() / s.min())
            self.applied.update({n: (sampler, s.float()) for n in names})  # each linear's input is now x / s
        return scales


class AWQ(_Smoothing):
    """AWQ's scale and clipping searches, with attention-sink tokens given `sink_share` of the loss.

    Sinks (see `gptq.sink_token_weights`) are a token or two per window with residual norms tens
    of times the others'; in a plain mean they dominate both the mean |x| that shapes the scales
    and the output MSE that picks them. `sink_share` 0 is textbook AWQ."""

    def _row_weights(self, sampler: ActivationSampler):
        norms = sampler.norms()
        return None if norms is None else sink_weights_from_norms(norms, self.sink_share)

    def scale_for(self, sampler, weights, names):
        args = self.targets_args[names[0]]
        s, best, at_one = awq_search_scale(sampler.sample(), weights, args,
                                           row_weights=self._row_weights(sampler))
        self.losses[names[0]] = (best, at_one)
        return s

    def observers(self, index, layer):
        hooks = super().observers(index, layer)
        o_proj = self.family.projections["o_proj"][0]
        if self.clip and o_proj in self.targets.get(index, {}):
            self.samplers[o_proj] = ActivationSampler()
            hooks[o_proj] = self._adder(self.samplers[o_proj])
            hooks.setdefault("", self._note_norms)
        return hooks

    def __init__(self, targets, sink_share: float, clip: bool = True):
        super().__init__(targets)
        self.clip, self.sink_share = clip, sink_share

    def process(self, index, layer):
        self.targets_args, self.losses = self.targets.get(index, {}), {}
        spread = self._smooth_layer(index, layer)
        clipped = self._clip_layer(layer) if self.clip else {}
        self.samplers = {}
        stats = self._rtn(index, layer)
        if clipped:
            stats["clipped_share"] = clipped
        stats["awq_loss_vs_rtn"] = {k: b / max(a, 1e-20) for k, (b, a) in self.losses.items()}
        stats["scale_spread"] = spread
        return stats

    def _clip_layer(self, layer) -> dict:
        """Per-group clipping ranges searched on each linear's (scaled) inputs; share of groups clipped."""
        shares = {}
        o_proj = self.family.projections["o_proj"][0]
        if o_proj in self.samplers:
            self.applied[o_proj] = (self.samplers[o_proj], None)
        runs = clip_rows(layer_rows(self.family, layer))
        for name, args in self.targets_args.items():
            if name not in runs or name not in self.applied:
                continue
            sampler, s = self.applied[name]
            x = sampler.sample() if s is None else sampler.sample() / s
            linear, clipped, groups = layer.get_submodule(name), 0, 0
            for start, end in runs[name]:
                w = linear.weight.data[start:end]
                max_val = awq_search_clip(x, w.float(), args, row_weights=self._row_weights(sampler))
                org = w.float().abs().reshape(max_val.shape[0], max_val.shape[1], -1).amax(-1)
                linear.weight.data = with_rows(linear.weight.data, start, end, apply_clip(w, max_val, args))
                clipped, groups = clipped + int((max_val < org).sum()), groups + max_val.numel()
            shares[name] = clipped / groups
        return shares


class SmoothQuant(_Smoothing):
    instead = "rtn --scheme W8A8"

    def __init__(self, targets, alpha: float):
        super().__init__(targets, activations=True)
        self.alpha = alpha

    def scale_for(self, sampler, weights, names):
        return smooth_scales(sampler.absmax, weights, self.alpha)

    def process(self, index, layer):
        spread = self._smooth_layer(index, layer)
        self.samplers = {}
        errors = {}
        for name, args in self.targets.get(index, {}).items():
            linear = layer.get_submodule(name)
            w = linear.weight.data.float()
            scale, _ = compute_qparams(w, args)  # per channel, symmetric int8: the W8A8 weight layout
            errors[name] = self._store(index, name, linear, quantize(w, scale, None, args), scale, None, args)
        return {"rel_weight_error": errors, "scale_spread": spread}
