"""The cpu-native backend's fused decode step: every decoder layer of a decode step in one native call.

A decode step of few sequences spends more time between ops (Python, dispatch: a few microseconds each,
about a dozen per layer) than in several of them. `csrc/layer.c` runs the same native kernels in the same
order and element type as the per-layer path, so its results are bit-identical
(tests/stages/serve/test_model.py checks that against the Python layer).

It is built once from the runtime's layers (`FusedDecode.build`) and exists only where every part has a
native form: fp32/bf16 on CPU with the AVX-512 GEMVs, each projection on a native GEMV (dense, int4 or
int8; not W8A8, mixed-scheme projections or tensor-parallel wrappers), and a SiLU gate (`layer.c` runs
SwiGLU only). A step runs through it when its attention's plan allows (`NativeCpuAttention.fused_plan`,
which also refuses a step whose sliding window would matter: `layer.c` has none); otherwise the caller runs
the layers one by one.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from . import cpu_native


class FusableLayer(Protocol):
    """What the fused step reads of a decoder layer (the serve runtime's DecoderLayer has these)."""

    qkv: torch.nn.Module  # [H] -> [(Hq + 2 Hk) * D]
    o_proj: torch.nn.Module  # [Hq * D] -> [H]
    gate_up: torch.nn.Module  # [H] -> [2 I]
    down: torch.nn.Module  # [I] -> [H]
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    heads: int
    kv_heads: int
    head_dim: int
    eps: float


class FusedDecode:
    """`cpu_native.DecodeLayers` plus the glue that feeds it a step's plan and cache."""

    def __init__(self, layers: cpu_native.DecodeLayers):
        self.layers = layers

    @classmethod
    def build(cls, layers: Sequence[FusableLayer]) -> "FusedDecode | None":
        """The fused step of `layers`, or None where any part has no native form."""
        if not layers or not cpu_native.gemv_available():
            return None
        first = layers[0]
        dtype = first.input_norm.dtype
        if first.input_norm.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return None
        described, keep, rows = [], [], []
        for layer in layers:
            if getattr(layer, "activation", "silu") != "silu":  # GeGLU (Gemma): layer.c would run SwiGLU
                return None
            natives = [getattr(p, "native", None) for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            norms = (layer.input_norm, layer.post_norm)
            if any(n is None for n in natives) or any(t.dtype != dtype or not t.is_contiguous() for t in norms):
                return None
            descs = [n.desc() for n in natives]
            described.append((*[d[0] for d in descs], *norms))
            keep += [t for d in descs for t in d[1]] + list(norms)
            rows += [n.max_rows for n in natives]
        hidden, inter = first.o_proj.out_features, first.down.in_features
        return cls(cpu_native.DecodeLayers(described, dtype, hidden, first.heads, first.kv_heads, first.head_dim,
                                           inter, first.eps, keep, min(rows)))

    @property
    def max_rows(self) -> int:
        """The most sequences a fused step may have (the smallest row limit of the layers' GEMVs)."""
        return self.layers.max_rows

    def __call__(self, x: torch.Tensor, attn, kv_caches: torch.Tensor):
        """(last layer's MLP output, residual stream) [T, H] for the embeddings x [T, H] (then holding the
        residual stream, in place), or None when `attn`'s step is not one the fused step takes.
        kv_caches: every layer's cache stacked, [layers, num_blocks, block_size, 2, Hk, D]."""
        plan = attn.fused_plan(x.shape[0], self.max_rows, kv_caches.dtype)
        if plan is None:
            return None
        cos_sin, slots, tables, lens, scale, block_size = plan
        out = self.layers.run(x, cos_sin, slots, kv_caches.view(kv_caches.shape[0], -1), tables, lens, scale,
                              block_size)
        return out, x
