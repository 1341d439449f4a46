"""Layer-by-layer calibration driver shared by quantize and prune.

Calibration windows run through the embedding once; then, decoder layer by decoder layer, the
layer's linear inputs are observed (forward hooks), the method rewrites the layer's weights, and
the already-rewritten layer produces the next layer's inputs. Only one layer (and the activations)
sits on the compute device at a time: peak memory is about one layer plus activations.

Also what both stages need to pick their Linears (names, --ignore patterns) and to run GPTQ-style
column loops (`one_thread`).
"""
from __future__ import annotations

import ctypes
import fnmatch
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import torch
from torch import nn

from .errors import ConfigError


class LayerMethod(Protocol):
    """What a stage plugs into the driver."""

    def observers(self, index: int, layer: nn.Module) -> dict[str, Callable[[torch.Tensor], None]]:
        """Submodule name (inside the layer) -> callback receiving that submodule's input [B, S, in]."""

    def process(self, index: int, layer: nn.Module) -> dict:
        """Rewrite the layer's weights after observation; return per-layer statistics."""

    # Optional: `finish(index, layer)` runs once the rewritten layer has produced the next layer's
    # inputs, e.g. to write the layer out and free its weights.


@dataclass
class LayerReport:
    index: int
    seconds: float
    stats: dict = field(default_factory=dict)


class _Stop(Exception):
    """Raised by the capture hook: nothing past the first decoder layer needs to run."""


def decoder_layers(model) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError(f"{type(model).__name__}: no model.layers; layer-by-layer stages support "
                          "decoder-only models with model.layers (the families of stages/families.py: Llama, Mistral, Qwen2/3, "
                          "Phi-3, Gemma 3)")
    return layers


def linear_names(model) -> list[str]:
    """The full names of every nn.Linear in the model, in module order."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def name_matches(name: str, pattern: str) -> bool:
    """Whether a module's full name matches an --ignore pattern: the name, a dotted suffix of it
    (`lm_head`, `mlp.down_proj`), a glob, or `re:` and a regular expression searched in it."""
    if pattern.startswith("re:"):
        return re.search(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern) or name == pattern or name.endswith("." + pattern)


def check_patterns(names: list[str], patterns: Iterable[str]) -> None:
    """Refuse an --ignore pattern that matches none of `names` (a typo would silently ignore nothing)."""
    for pattern in patterns:
        if not any(name_matches(n, pattern) for n in names):
            raise ConfigError(f"--ignore {pattern} matches no Linear layer (e.g. {names[0]}, {names[-1]})")


@contextmanager
def one_thread():
    """Torch on one thread inside the block. GPTQ's and SparseGPT's column loops are thousands of
    tiny ops: threads only add synchronisation (10x slower on a busy 2-core machine, measured)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


@torch.inference_mode()
def capture_inputs(model, windows: torch.Tensor, batch_size: int) -> list[tuple[torch.Tensor, dict]]:
    """(hidden [b, S, H], layer kwargs) per batch, as the first decoder layer receives them."""
    first = decoder_layers(model)[0]
    captured: list[tuple[torch.Tensor, dict]] = []

    def grab(module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value", "use_cache")}
        captured.append((hidden.detach(), kwargs))
        raise _Stop

    handle = first.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for i in range(0, len(windows), batch_size):
            try:
                model(input_ids=windows[i:i + batch_size], use_cache=False)
            except _Stop:
                continue
    finally:
        handle.remove()
    return captured


@torch.inference_mode()
def forward_layer(layer, batches: list[tuple[torch.Tensor, dict]], device, keep: bool) -> list:
    """Run one decoder layer over every captured batch (hidden [b, S, H], kwargs); with `keep`, its
    outputs as the next layer's batches (on the inputs' device), else []."""
    outs = []
    for hidden, kwargs in batches:
        out = layer(_to(hidden, device), **_to(kwargs, device))
        out = out[0] if isinstance(out, tuple) else out
        if keep:
            outs.append((out.to(hidden.device), kwargs))
    return outs


def run_layerwise(model, windows: torch.Tensor, method: LayerMethod, device: str = "cpu",
                  batch_size: int = 8, on_layer: Callable[[LayerReport, int], None] | None = None) -> list[LayerReport]:
    """Drive `method` over every decoder layer; returns one report per layer."""
    layers = decoder_layers(model)
    batches = capture_inputs(model, windows, batch_size)
    reports = []
    for index, layer in enumerate(layers):
        start = time.perf_counter()
        layer.to(device)
        handles = [layer.get_submodule(name).register_forward_pre_hook(input_observer(cb))
                   for name, cb in method.observers(index, layer).items()]
        try:
            forward_layer(layer, batches, device, keep=False)
        finally:
            for h in handles:
                h.remove()
        with torch.no_grad():
            stats = method.process(index, layer)
        if index + 1 < len(layers):  # the last layer's outputs feed nothing
            batches = forward_layer(layer, batches, device, keep=True)
        layer.to("cpu")
        if hasattr(method, "finish"):
            method.finish(index, layer)
        _return_freed_memory()
        report = LayerReport(index, time.perf_counter() - start, stats)
        reports.append(report)
        if on_layer:
            on_layer(report, len(layers))
    return reports


def _return_freed_memory() -> None:
    """Hand freed heap pages back to the OS between layers. glibc keeps them in per-thread arenas
    otherwise, and a long layer-by-layer run then looks (and is, to the OS) as big as its worst layer
    times the threads (results.md, "GPTQ peak memory")."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        return


def input_observer(callback: Callable[[torch.Tensor], None]):
    """A forward pre-hook that hands a module's input [B, S, in] (detached) to `callback`."""
    def hook(module, args):
        callback(args[0].detach())
    return hook
