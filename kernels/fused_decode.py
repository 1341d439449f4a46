"""The cpu-native backend's fused decode step: every decoder layer of a decode step in one native call.

A decode step of few sequences spends more time between ops (Python, dispatch: a few microseconds each,
about a dozen per layer) than in several of them. `csrc/layer.c` runs the same native kernels in the same
order and element type as the per-layer path, so its results are bit-identical
(tests/stages/serve/test_model.py checks that against the Python layer).

It is built once from the runtime's layers (`FusedDecode.build`) and exists only where every part has a
native form: fp32/bf16 on CPU with the AVX-512 GEMVs, each projection on a native GEMV (dense, int4 or
int8; not W8A8, mixed-scheme projections or tensor-parallel wrappers). Every family's layer of
stages/families.py is one: the optional q/k and sandwich norms, SwiGLU or GeGLU, and per KV layer group its
own cache slots, block tables, RoPE table and window. A step runs through it when every group's attention
plan allows (`NativeCpuAttention.fused_plan`); otherwise the caller runs the layers one by one.
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
    q_norm: torch.Tensor | None  # [D], per head before RoPE (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None
    attn_out_norm: torch.Tensor | None  # [H], on the attention block's output (Gemma)
    mlp_out_norm: torch.Tensor | None  # [H], on the MLP's output (Gemma)
    activation: str  # "silu" | "gelu_tanh"
    kv_group: int  # its KV layer group (the step's attention object and tables it reads)
    kv_slot: int  # its slot in the cache's first dimension
    heads: int
    kv_heads: int
    head_dim: int
    eps: float


OPTIONAL_NORMS = ("q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")


class FusedDecode:
    """`cpu_native.DecodeLayers` plus the glue that feeds it a step's plans and cache."""

    def __init__(self, layers: cpu_native.DecodeLayers):
        self.layers = layers

    @classmethod
    def build(cls, layers: Sequence[FusableLayer]) -> "FusedDecode | None":
        """The fused step of `layers`, or None where any part has no native form."""
        if not layers or not cpu_native.gemv_available():
            return None
        first = layers[0]
        dtype = first.input_norm.dtype
        if first.input_norm.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) \
                or len({layer.activation for layer in layers}) > 1 or first.activation not in ("silu", "gelu_tanh"):
            return None
        described, keep, rows = [], [], []
        for layer in layers:
            natives = [getattr(p, "native", None) for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            norms = {n: getattr(layer, n) for n in ("input_norm", "post_norm", *OPTIONAL_NORMS)}
            if any(n is None for n in natives) or any(t is not None and (t.dtype != dtype or not t.is_contiguous())
                                                      for t in norms.values()):
                return None
            descs = [n.desc() for n in natives]
            described.append(cpu_native.DecodeLayer(*[d[0] for d in descs], **norms, group=layer.kv_group,
                                                    cache_slot=layer.kv_slot))
            keep += [t for d in descs for t in d[1]] + [t for t in norms.values() if t is not None]
            rows += [n.max_rows for n in natives]
        hidden, inter = first.o_proj.out_features, first.down.in_features
        return cls(cpu_native.DecodeLayers(described, dtype, hidden, first.heads, first.kv_heads, first.head_dim,
                                           inter, first.eps, keep, min(rows), gelu=first.activation == "gelu_tanh"))

    @property
    def max_rows(self) -> int:
        """The most sequences a fused step may have (the smallest row limit of the layers' GEMVs)."""
        return self.layers.max_rows

    def __call__(self, x: torch.Tensor, attns: Sequence, kv_cache: torch.Tensor):
        """(last layer's MLP output, residual stream) [T, H] for the embeddings x [T, H] (then holding the
        residual stream, in place), or None when a step is not one the fused step takes. attns: the step's
        attention object of each KV layer group; kv_cache [slots, num_blocks, block_size, 2, Hk, D]."""
        plans = [attn.fused_plan(x.shape[0], self.max_rows, kv_cache.dtype) for attn in attns]
        if any(plan is None for plan in plans):
            return None
        groups = [cpu_native.GroupStep(p.slots, p.block_tables, p.cos_sin, p.window) for p in plans]
        first = plans[0]
        out = self.layers.run(x, groups, kv_cache.view(kv_cache.shape[0], -1), first.context_lens, first.scale,
                              first.block_size)
        return out, x
