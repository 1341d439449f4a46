"""The Llama-family runtime of the serve engine: Llama 2/3, Mistral, Qwen2 (qkv bias), SmolLM2.

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

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class ModelSpec:
    """What the runtime needs from config.json."""

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
    max_positions: int = 4096  # longest sequence the runtime serves (the window, if one is set)
    tie_word_embeddings: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _architecture(config: dict) -> str:
    archs = config.get("architectures") or [_MODEL_TYPES.get(config.get("model_type"), str(config.get("model_type")))]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"architecture {arch} is not supported by the serve runtime; "
                          f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (Llama 2/3, Mistral, Qwen2, SmolLM2)")
    return arch


def _rope(config: dict) -> tuple[float, dict]:
    """(theta, scaling dict) from `rope_theta`/`rope_scaling` (transformers 4) or `rope_parameters` (5)."""
    scaling = dict(config.get("rope_scaling") or {})
    scaling.update(config.get("rope_parameters") or {})
    theta = float(scaling.pop("rope_theta", config.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ConfigError(f"rope_type {kind!r} is not supported by the serve runtime (default, linear, llama3)")
    return theta, scaling


def _max_positions(config: dict) -> int:
    longest = int(config.get("max_position_embeddings", 4096))
    window = config.get("sliding_window")
    uses_window = config.get("use_sliding_window", config.get("model_type") != "qwen2")
    # Within the window, sliding-window attention is full attention: serve that much and no more.
    return min(longest, int(window)) if window and uses_window else longest


def spec_from_config(config: dict) -> ModelSpec:
    """A ModelSpec from a config.json dict; ConfigError for architectures outside the family."""
    arch = _architecture(config)
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {config['hidden_act']!r} is not supported (silu only)")
    try:
        return _spec(arch, config)
    except KeyError as e:
        raise ConfigError(f"config.json lacks {e.args[0]!r}, which a {arch} needs") from None


def _spec(arch: str, config: dict) -> ModelSpec:
    heads = int(config["num_attention_heads"])
    theta, scaling = _rope(config)
    return ModelSpec(
        architecture=arch, vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]), num_layers=int(config["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        max_positions=_max_positions(config), tie_word_embeddings=bool(config.get("tie_word_embeddings", False)))


class ConcatLinear(nn.Module):
    """Projections that could not be fused (mixed quantization schemes): outputs concatenated."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x):
        return torch.cat([p(x) for p in self.parts], dim=-1)


class DecoderLayer(nn.Module):
    """Pre-norm attention block and SwiGLU MLP with fused projections."""

    def __init__(self, spec: ModelSpec, backend: Backend, dtype=None):
        super().__init__()
        h = spec.hidden_size
        # The projections are the backend's modules, set by the loader:
        self.qkv: nn.Module | None = None  # [T, H] -> [T, (Hq + 2 Hk) * D]
        self.o_proj: nn.Module | None = None  # [T, Hq * D] -> [T, H]
        self.gate_up: nn.Module | None = None  # [T, H] -> [T, 2 I]
        self.down: nn.Module | None = None  # [T, I] -> [T, H]
        self.register_buffer("input_norm", torch.empty(h, dtype=dtype))
        self.register_buffer("post_norm", torch.empty(h, dtype=dtype))
        self.backend = backend
        self.eps, self.q_size, self.kv_size = spec.rms_norm_eps, spec.q_size, spec.kv_size
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim

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
        attn.rotate(qkv[:, :qs + ks], q, k)
        o = attn.attend(q, k, v, qkv[:, qs:], kv_cache)  # [T, Hq, D]
        x = self.o_proj(o.reshape(t, qs))
        h, residual = ops.rms_norm(x, self.post_norm, self.eps, residual)
        return self.down(ops.silu_and_mul(self.gate_up(h))), residual


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
        self.register_buffer("norm", torch.empty(spec.hidden_size, dtype=dtype))
        self.lm_head: nn.Module | None = None  # [R, H] -> [R, vocab]: the backend's module, set by the loader
        self.register_buffer("cos_sin_cache", None, persistent=False)  # [max_positions, head_dim] fp32
        self.tp: TensorParallel | None = None  # set on the ranks of a sharded model (serve/tp)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype  # the embedding may hold int8 codes

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
            return F.embedding(token_ids, self.embed_tokens) if lookup is None else lookup(token_ids)
        return vocab_parallel_embedding(token_ids, self.embed_tokens, self.tp.vocab_start, self.tp.group, lookup)

    def _dequantized_rows(self, token_ids):
        """Rows [T, H] of the int8 table, `q * scale` in fp32 then the runtime's dtype (as the eval path)."""
        codes, scale = self.embed_tokens[token_ids], self.embed_scale[token_ids]  # [T, H], [T, H/g]
        return dequantize(codes, scale).to(self.dtype)

    def forward(self, token_ids, attn, kv_caches, fused=None):
        """token_ids [T] -> (hidden, residual) [T, H] before the final norm. kv_caches: every layer's cache
        [num_blocks, block_size, 2, Hk, D], stacked in one tensor. fused: the backend's whole-model decode
        step (`Backend.fused_decode`), which replaces the layers for the steps it takes."""
        x = self.embed(token_ids)  # [T, H]
        out = fused(x, attn, kv_caches) if fused is not None else None
        if out is not None:
            return out
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):  # kv_cache [num_blocks, block_size, 2, Hk, D]
            x, residual = layer(x, residual, attn, kv_cache)
        return x, residual

    def compute_logits(self, x, residual, indices) -> torch.Tensor:
        """fp32 logits [R, vocab] of the rows `indices` only (final norm and lm_head skip the rest)."""
        h, _ = self.backend.rms_norm(x.index_select(0, indices), self.norm, self.spec.rms_norm_eps,
                                     residual.index_select(0, indices))
        logits = self.lm_head(h).float()  # [R, vocab (this rank's slice under tensor parallelism)]
        return logits if self.tp is None else gather_vocab(logits, self.tp.vocab_sizes, self.tp.group)


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
