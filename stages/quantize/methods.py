"""The layer methods (RTN, GPTQ, AWQ, SmoothQuant) that the layer-by-layer driver runs.

Each method quantizes the targeted Linears of one decoder layer, records the integer tensors for
export in `results`, and leaves the dequantized weights in the layer so that the next layer is
calibrated on the outputs of the already quantized one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..compressed import LinearScheme, compress_linear
from .awq import apply_clip, awq_search_clip, awq_search_scale
from .fold import apply_scale_to_linears, apply_scale_to_norm, apply_scale_to_prev_linear
from .gptq import HessianAccumulator, gptq_quantize, sink_token_weights, sink_weights_from_norms
from .rtn import QuantArgs, compute_qparams, dequantize, quantize
from .smoothquant import smooth_scales

# Llama-family layer: groups of linears that share one input, and where a scale on that input folds.
SHARED_INPUTS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)


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
    """

    def __init__(self, targets: dict[int, dict[str, QuantArgs]], activations: bool = False, sink=None):
        self.targets = targets
        self.activations = activations
        self.sink = sink
        self.results: dict[str, QuantizedLinear] = {}

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
        for _, names in SHARED_INPUTS:  # linears that read one input share one Hessian (q/k/v, gate/up)
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

    def observers(self, index, layer):
        self.samplers = {}
        for _, names in SHARED_INPUTS:
            if all(n in self.targets.get(index, {}) for n in names):
                self.samplers[names[0]] = ActivationSampler()
        hooks = {name: self._adder(s) for name, s in self.samplers.items()}
        return {"": self._note_norms, **hooks} if hooks else hooks

    def _note_norms(self, hidden):
        self._token_norms = hidden.float().norm(dim=-1).reshape(-1)

    def _adder(self, sampler: ActivationSampler):
        return lambda x: sampler.add(x, self._token_norms)

    def _fold(self, layer, prev: str, names, s: torch.Tensor) -> None:
        """Divide the input by s where it is produced, multiply the consuming weights by s."""
        prev_mod = layer.get_submodule(prev)
        fold = apply_scale_to_prev_linear if isinstance(prev_mod, nn.Linear) else apply_scale_to_norm
        prev_mod.weight.data, _ = fold(prev_mod.weight.data, s)
        linears = [layer.get_submodule(n) for n in names]
        for linear, w in zip(linears, apply_scale_to_linears([m.weight.data for m in linears], s)):
            linear.weight.data = w

    def _smooth_layer(self, index, layer) -> dict:
        scales, self.applied = {}, {}
        for prev, names in SHARED_INPUTS:
            sampler = self.samplers.get(names[0])
            if sampler is None:
                continue
            s = self.scale_for(sampler, [layer.get_submodule(n).weight.data.float() for n in names], names)
            self._fold(layer, prev, names, s.float())
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

    # AWQ leaves q/k unclipped: their errors pass through softmax, where the output MSE misleads.
    NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")

    def observers(self, index, layer):
        hooks = super().observers(index, layer)
        if self.clip and "self_attn.o_proj" in self.targets.get(index, {}):
            self.samplers["self_attn.o_proj"] = ActivationSampler()
            hooks["self_attn.o_proj"] = self._adder(self.samplers["self_attn.o_proj"])
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
        if "self_attn.o_proj" in self.samplers:
            self.applied["self_attn.o_proj"] = (self.samplers["self_attn.o_proj"], None)
        for name, args in self.targets_args.items():
            if name in self.NO_CLIP or name not in self.applied:
                continue
            sampler, s = self.applied[name]
            x = sampler.sample() if s is None else sampler.sample() / s
            linear = layer.get_submodule(name)
            max_val = awq_search_clip(x, linear.weight.data.float(), args, row_weights=self._row_weights(sampler))
            org = linear.weight.data.float().abs().reshape(max_val.shape[0], max_val.shape[1], -1).amax(-1)
            linear.weight.data = apply_clip(linear.weight.data, max_val, args)
            shares[name] = float((max_val < org).float().mean())
        return shares


class SmoothQuant(_Smoothing):
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
