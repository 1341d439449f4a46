"""The decoder runtime of the serve engine, for every family of `stages/families.py` (Llama 2/3, Mistral,
Qwen2/3, Phi-3, Gemma 3, SmolLM2).

One flat batch of T new tokens goes through every layer; attention reads and writes the paged KV
cache through a per-step attention object that the runner has the backend build once per step.
q/k/v and gate/up are fused projections (their weights concatenated at load time, see
`loader.py`), so a layer is six matmul-sized ops plus a few elementwise ones.

This file describes the model only. Every op whose kernel depends on the device (projections, norm,
SwiGLU, RoPE, attention) comes from the `llmopt.kernels` backend the runtime was loaded with: the
loader has it build the projection modules, the layers call its norm and SwiGLU.

Weights: `Runtime` is built on the meta device from a `ModelSpec`; the loader sets the projection
modules and assigns the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.kernels import Backend, dequantize
from llmopt.kernels.parallel import gather_vocab, vocab_parallel_embedding

from ..errors import ConfigError
from ..families import FAMILIES, Family, LayerAttention, ModelShape, Rope, describe, family_of, supported_architectures

SUPPORTED_ARCHITECTURES = supported_architectures()


@dataclass(frozen=True)
class ModelSpec:
    """What the runtime needs from config.json: sizes, and the family's variant per layer (`shape`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict, hash=False)
    max_positions: int = 4096  # longest sequence the runtime serves
    tie_word_embeddings: bool = False
    shape: ModelShape | None = field(default=None, hash=False)  # None: Llama's (tests that build specs by hand)

    def __post_init__(self):
        if self.shape is None:
            rope = Rope(self.rope_theta, tuple(sorted(self.rope_scaling.items())))
            llama = ModelShape(FAMILIES[0], "silu", self.head_dim ** -0.5, None, None,
                               (LayerAttention(None, rope),) * self.num_layers)
            object.__setattr__(self, "shape", llama)

    @property
    def family(self) -> Family:
        return self.shape.family

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def spec_from_config(config: dict) -> ModelSpec:
    """A ModelSpec from a config.json dict; ConfigError for architectures or variants the runtime does not run."""
    family = family_of(config)
    try:
        shape = describe(config)
        heads = int(config["num_attention_heads"])
        return ModelSpec(
            architecture=family.architectures[0], vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]), intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=shape.layers[0].rope.theta,
            rope_scaling=shape.layers[0].rope.scaling_dict,
            max_positions=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), shape=shape)
    except KeyError as e:
        raise ConfigError(f"config.json lacks {e.args[0]!r}, which a {family.architectures[0]} needs") from None


class ConcatLinear(nn.Module):
    """Projections that could not be fused (mixed quantization schemes): outputs concatenated."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x):
        return torch.cat([p(x) for p in self.parts], dim=-1)


# The runtime's norm buffers by the family's norm slots (stages/families.py NORM_SLOTS).
NORM_BUFFERS = {"input": "input_norm", "mlp": "post_norm", "attn_out": "attn_out_norm", "mlp_out": "mlp_out_norm",
                "q": "q_norm", "k": "k_norm"}


class DecoderLayer(nn.Module):
    """Pre-norm attention block and gated MLP with fused projections; the family's variant decides which of
    the optional norms exist (q/k norms, Gemma's sandwich norms on each block's output) and the gate's
    activation; the backend's fused decode step computes every variant (kernels/csrc/layer.c)."""

    def __init__(self, spec: ModelSpec, backend: Backend, dtype=None):
        super().__init__()
        h, family = spec.hidden_size, spec.family
        # The projections are the backend's modules, set by the loader:
        self.qkv: nn.Module | None = None  # [T, H] -> [T, (Hq + 2 Hk) * D]
        self.o_proj: nn.Module | None = None  # [T, Hq * D] -> [T, H]
        self.gate_up: nn.Module | None = None  # [T, H] -> [T, 2 I]
        self.down: nn.Module | None = None  # [T, I] -> [T, H]
        for slot, name in NORM_BUFFERS.items():
            size = spec.head_dim if slot in ("q", "k") else h
            self.register_buffer(name, torch.empty(size, dtype=dtype) if slot in family.norms else None)
        self.backend = backend
        self.eps, self.q_size, self.kv_size = spec.rms_norm_eps, spec.q_size, spec.kv_size
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.activation = spec.shape.activation

    def forward(self, x, residual, attn, kv_cache):
        """x, residual [T, H] -> (mlp output, residual stream); residual None in the first layer."""
        ops = self.backend
        if residual is None:
            h, residual = ops.rms_norm(x, self.input_norm, self.eps), x
        else:
            h, residual = ops.rms_norm(x, self.input_norm, self.eps, residual)
        qkv = self.qkv(h)  # [T, (Hq + 2 Hk) * D]
        t, qs, ks = qkv.shape[0], self.q_size, self.kv_size
        q = qkv[:, :qs].view(t, self.heads, self.head_dim)  # [T, Hq, D]
        k = qkv[:, qs:qs + ks].view(t, self.kv_heads, self.head_dim)  # [T, Hk, D]
        v = qkv[:, qs + ks:].view(t, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            self._head_norm(q, self.q_norm)
        if self.k_norm is not None:
            self._head_norm(k, self.k_norm)
        attn.rotate(qkv[:, :qs + ks], q, k)
        o = attn.attend(q, k, v, qkv[:, qs:], kv_cache)  # [T, Hq, D]
        x = self.o_proj(o.reshape(t, qs))
        if self.attn_out_norm is not None:
            x = ops.rms_norm(x, self.attn_out_norm, self.eps)
        h, residual = ops.rms_norm(x, self.post_norm, self.eps, residual)
        gate_up = self.gate_up(h)  # [T, 2 I]
        x = self.down(ops.silu_and_mul(gate_up) if self.activation == "silu" else ops.gelu_tanh_and_mul(gate_up))
        if self.mlp_out_norm is not None:
            x = ops.rms_norm(x, self.mlp_out_norm, self.eps)
        return x, residual

    def _head_norm(self, x, weight):
        """RMSNorm of every head of x [T, heads, D] over D, written back into x (a view of the fused qkv)."""
        t = x.shape[0]
        x.copy_(self.backend.rms_norm(x.reshape(t * x.shape[1], self.head_dim), weight, self.eps).view_as(x))


class Runtime(nn.Module):
    """Embedding, decoder layers, final norm and lm_head (tied: the embedding matrix).

    The embedding is a dense table, or int8 codes [vocab, H] with group scales `embed_scale` [vocab, H/g]
    (`--embeddings int8`): a lookup dequantizes only the rows it reads, and a tied lm_head shares the codes.
    """

    def __init__(self, spec: ModelSpec, backend: Backend, dtype=None):
        super().__init__()
        self.spec, self.backend = spec, backend
        self.register_buffer("embed_tokens", torch.empty(spec.vocab_size, spec.hidden_size, dtype=dtype))
        self.register_buffer("embed_scale", None)
        self.layers = nn.ModuleList(DecoderLayer(spec, backend, dtype) for _ in range(spec.num_layers))
        for layer, group, slot in zip(self.layers, spec.shape.kv.groups, spec.shape.kv.slots):
            layer.kv_group, layer.kv_slot = group, slot  # what the fused decode step reads of the cache layout
        self.register_buffer("norm", torch.empty(spec.hidden_size, dtype=dtype))
        self.lm_head: nn.Module | None = None  # [R, H] -> [R, vocab]: the backend's module, set by the loader
        # One cos||sin table [max_positions, head_dim] fp32 per RoPE of the model's attention kinds (Gemma 3: a
        # local and a global base), set by the loader; `cos_sin_cache` is the first.
        self.rope_caches: list[torch.Tensor] = []
        # Layers attend by KV-cache layer group: each group's own block tables, its layers' window and RoPE.
        self.kv_groups = spec.shape.kv
        self.tp: TensorParallel | None = None  # set on the ranks of a sharded model (serve/tp)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype  # the embedding may hold int8 codes

    @property
    def cos_sin_cache(self) -> torch.Tensor:
        return self.rope_caches[0]

    def attentions(self, backend: Backend, metas: list, scale: float, block_size: int) -> list:
        """One attention object per KV layer group, from its step metadata `metas[g]` (layer i uses
        `[kv_groups.groups[i]]`)."""
        ropes = list(dict.fromkeys(k.rope for k in self.kv_groups.kinds))
        out = []
        for kind, meta in zip(self.kv_groups.kinds, metas):
            table = self.rope_caches[ropes.index(kind.rope)]
            window = {} if kind.window is None else {"window": kind.window}
            out.append(backend.attention(meta, table, scale, block_size, self.dtype, **window))
        return out

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def vocab_size(self) -> int:
        """The whole vocabulary (a tensor-parallel rank holds only a slice of it)."""
        return self.tp.vocab_size if self.tp is not None else self.spec.vocab_size

    def embed(self, token_ids):
        lookup = None if self.embed_scale is None else self._dequantized_rows
        if self.tp is None:
            x = F.embedding(token_ids, self.embed_tokens) if lookup is None else lookup(token_ids)
        else:
            x = vocab_parallel_embedding(token_ids, self.embed_tokens, self.tp.vocab_start, self.tp.group, lookup)
        scale = self.spec.shape.embedding_scale
        # Gemma: sqrt(H) rounded to the model's dtype first, as transformers does
        return x if scale is None else x * torch.tensor(scale, dtype=x.dtype)

    def _dequantized_rows(self, token_ids):
        """Rows [T, H] of the int8 table, `q * scale` in fp32 then the runtime's dtype (as the eval path)."""
        codes, scale = self.embed_tokens[token_ids], self.embed_scale[token_ids]  # [T, H], [T, H/g]
        return dequantize(codes, scale).to(self.dtype)

    def forward(self, token_ids, attns, kv_caches, fused=None, hidden=None):
        """token_ids [T] -> (hidden, residual) [T, H] before the final norm. attns: the step's attention
        objects, one per KV layer group (`attentions`). kv_caches: each layer's cache [num_blocks,
        block_size, 2, Hk, D]. fused: `fused(x, attns)`, the backend's whole-model decode step
        (`Backend.fused_decode`) bound to the cache, which replaces the layers for the steps it takes.
        hidden: a later pipeline stage's input [T, H], the residual stream the stage before handed on
        (`stream`), in place of the embeddings; its first layer normalises it as layer 0 does its input."""
        x = self.embed(token_ids) if hidden is None else hidden  # [T, H]
        out = fused(x, attns) if fused is not None else None
        if out is not None:
            return out
        residual = None
        for layer, group, kv_cache in zip(self.layers, self.kv_groups.groups, kv_caches):
            x, residual = layer(x, residual, attns[group], kv_cache)  # kv_cache [blocks, block_size, 2, Hk, D]
        return x, residual

    @staticmethod
    def stream(x, residual) -> torch.Tensor:
        """The residual stream after the last layer run, `x + residual` rounded to the dtype: what a pipeline
        stage hands the next. The next layer's norm adds the same two and rounds first (the native and
        torch kernels), so starting the next stage from the sum is the same arithmetic (fp32: always)."""
        return x if residual is None else x + residual

    def compute_logits(self, x, residual, indices) -> torch.Tensor:
        """fp32 logits [R, vocab] of the rows `indices` only (final norm and lm_head skip the rest)."""
        h, _ = self.backend.rms_norm(x.index_select(0, indices), self.norm, self.spec.rms_norm_eps,
                                     residual.index_select(0, indices))
        logits = self.lm_head(h).float()  # [R, vocab (this rank's slice under tensor parallelism)]
        logits = logits if self.tp is None else gather_vocab(logits, self.tp.vocab_sizes, self.tp.group)
        cap = self.spec.shape.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


@dataclass
class TensorParallel:
    """What a rank's runtime needs to know of its group: the collectives' group and its vocab slice."""

    group: object
    rank: int
    vocab_start: int
    vocab_sizes: list[int]

    @property
    def vocab_size(self) -> int:
        return sum(self.vocab_sizes)
