"""The Llama-family runtime of the serve engine: Llama 2/3, Mistral, Qwen2 (qkv bias), SmolLM2.

One flat batch of T new tokens goes through every layer; attention reads and writes the paged KV
cache through a per-step attention object (`attention.py`) that the runner builds once per step.
q/k/v and gate/up are fused projections (their weights concatenated at load time, see
`loader.py`), so a layer is six matmul-sized ops plus a few elementwise ones.

Weights: `Runtime` is built on the meta device from a `ModelSpec`; the loader swaps in the
projection modules (dense or the quantized linears of `kernels/`) and assigns the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.kernels import cpu_native, dequantize, rms_norm, silu_and_mul
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


def apply_norm(x, weight, eps, residual=None, backend=None):
    """RMSNorm of x (or of x + residual, then also returning that sum, the new residual stream).

    backend "cpu": the native kernel (one call; residual updated in place), else torch's own fused
    rms_norm, which measured ~25 % faster than the kernels' fp32 twin at decode sizes. Otherwise the
    kernel (Triton on CUDA; residual updated in place).
    """
    if backend == "cpu" and cpu_native.ops_supported(x.dtype) and x.dim() == 2 and x.stride(1) == 1 \
            and weight.dtype == x.dtype and (residual is None or residual.stride(1) == 1):
        return cpu_native.add_rms_norm(x, weight, eps, residual)
    if backend != "cpu":
        return rms_norm(x, weight, eps, backend=backend) if residual is None \
            else rms_norm(x, weight, eps, residual, backend=backend)
    if residual is None:
        return F.rms_norm(x, weight.shape, weight, eps)
    residual = x + residual
    return F.rms_norm(residual, weight.shape, weight, eps), residual


def swiglu(x, backend=None):
    """silu(gate) * up on the fused gate||up output [T, 2I] -> [T, I]."""
    if backend != "cpu":
        return silu_and_mul(x, backend=backend)
    if cpu_native.ops_supported(x.dtype) and x.stride(-1) == 1 and x.dim() == 2:
        return cpu_native.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


class DenseLinear(nn.Module):
    """`x @ weight.T + bias` on a plain (possibly fused) weight [N, K].

    On CPU the weight is converted once (`prepare_cpu`) into the layouts of the fastest kernels
    measured here (30 layers of SmolLM2 shapes + lm_head, weights streamed from memory):
    - decode-sized calls (up to `cpu_native.GEMV_MAX_ROWS` rows): the native GEMV on a tiled copy, which
      streams the weight at 25-28 GB/s where torch's default F.linear (MKL) reached a third of the
      machine's read bandwidth (fp32, batch 1: 21 ms for the model's weights vs 28 ms oneDNN, 35 ms MKL);
    - more rows: oneDNN on a reordered weight (1.2-2x faster than MKL at 2+ rows in fp32 and at every
      batch size in bf16);
    - without the native library, fp32 with one row: MKL on the transposed weight [K, N].
    """

    PACK_BATCH = 8  # oneDNN's batch hint for the reorder; 8 measured as fast as 1 at batch 1

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None):
        super().__init__()
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=dtype))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)
        self.packed = self.weight_t = self.native = self.bias_f32 = None  # CPU layouts, set by prepare_cpu()
        self.native_rows = 0  # calls of up to this many rows take the native GEMV
        self.released: tuple[str, ...] = ()  # buffers left on the meta device once their layouts exist

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "DenseLinear":
        """Wrap existing tensors (no allocation, no copy)."""
        with torch.device("meta"):
            layer = cls(weight.shape[1], weight.shape[0], bias is not None, weight.dtype)
        layer.weight, layer.bias = weight, bias
        return layer

    def prepare_cpu(self, native: bool = True) -> "DenseLinear":
        """Convert the weight for the CPU kernels (fp32/bf16 on CPU; otherwise F.linear stays). `native`
        False: no GEMV copy (the fallback of a quantized linear, which has its own for few rows)."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16) \
                or not torch.backends.mkldnn.is_available():
            return self
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), self.PACK_BATCH)
        if native and cpu_native.gemv_available():
            self.native = cpu_native.DenseWeight(w)
            self.native_rows = cpu_native.GEMV_MAX_ROWS[w.dtype]
            self.bias_f32 = None if self.bias is None else self.bias.float().contiguous()
            # Both CPU paths now hold their own copy: the loaded one goes (one model's worth of memory; a tied
            # lm_head's stays alive as the embedding). Shape and dtype remain, on the meta device; forward
            # refuses every path that would need the values (torch's CPU ops read a meta tensor as garbage).
            self.weight = w.to("meta")
            self.released = ("weight",)
        elif w.dtype == torch.float32:
            self.weight_t = w.t().contiguous()  # [K, N]
            self.weight = self.weight_t.t()  # a view: an unshared fused copy is freed
        return self

    def forward(self, x):
        if self.packed is None or x.device.type != "cpu":
            if self.released:
                raise RuntimeError(f"DenseLinear: prepared for CPU (its loaded weight was released); got {x.device} "
                                   "input. Load the runtime on the device it runs on.")
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        if rows <= self.native_rows:
            return cpu_native.gemv(x if x.stride(1) == 1 else x.contiguous(), self.native, self.bias_f32)
        if self.weight_t is not None and rows == 1:
            y = torch.mm(x, self.weight_t)  # [1, N]
            return y if self.bias is None else y.add_(self.bias)
        return on_row_buckets(self._onednn, x)

    def _onednn(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")

    def native_desc(self):
        """(C description, most rows it serves, tensors to keep) for the fused native decode step, or None."""
        if self.native is None:
            return None
        return cpu_native.linear_desc(self.native, self.bias_f32), self.native_rows, [self.native, self.bias_f32]


ROW_CHUNK = 512  # rows per oneDNN call beyond this; larger calls were no faster per row here


def row_bucket(rows: int) -> int:
    """The row count a CPU matmul of `rows` rows is padded to: exact up to 16; then eight steps per
    power of two up to 64 (17..32 by 2, 33..64 by 4: decode batches, at most 12.5% padding); beyond,
    four (65..128 by 16, ...: mostly prefill chunks, at most 25%), so that the rarely seen large
    shapes are few and all seen early."""
    if rows <= 16:
        return rows
    bits = (rows - 1).bit_length()
    step = 1 << (bits - (4 if bits <= 6 else 3))
    return -(-rows // step) * step


def on_row_buckets(matmul, x: torch.Tensor) -> torch.Tensor:
    """`matmul(x)` for x [M, K], called only on row counts from a small fixed set.

    oneDNN builds and caches a primitive per input shape, each holding from a few hundred KiB to
    over 1 MiB (measured: 1,600 distinct row counts on SmolLM2's four projection shapes took 1.36 GiB,
    and once its 1,024-entry cache evicts, rebuilding grows memory further). A serving engine sees
    a new row count at almost every step, so without this its RSS grows for thousands of requests.
    Rows are zero-padded up to `row_bucket` and calls beyond ROW_CHUNK rows are split, so one weight
    meets at most 44 shapes; the padding rows are computed and dropped.
    """
    rows = x.shape[0]
    if rows > ROW_CHUNK:
        return torch.cat([on_row_buckets(matmul, x[i:i + ROW_CHUNK]) for i in range(0, rows, ROW_CHUNK)])
    padded = row_bucket(rows)
    if padded == rows:
        return matmul(x)
    xp = x.new_empty(padded, x.shape[1])
    xp[:rows] = x
    xp[rows:] = 0
    return matmul(xp)[:rows]


def prebuild_row_buckets(runtime: nn.Module, max_tokens: int, max_logit_rows: int) -> int:
    """Run every CPU (oneDNN) dense weight shape of `runtime` once at each row bucket a step can produce,
    on zeros, so that the primitives oneDNN keeps per shape are all built now: memory is then taken
    once at start-up, like the KV cache, instead of creeping up as serving meets new batch sizes.

    Primitives belong to shapes, not weights, so one layer of each distinct shape is run: the decoder
    projections up to `max_tokens` rows (a step's token budget; more is split into ROW_CHUNK calls),
    the lm_head up to `max_logit_rows` (one row per sequence). Returns the number of calls made.
    SmolLM2-135M, fp32, budgets 2,048 / 256: 212 calls, about a second here.
    """
    seen, calls = set(), 0
    for name, module in runtime.named_modules():
        if not isinstance(module, DenseLinear) or module.packed is None:
            continue
        w = module.weight
        key = (tuple(w.shape), w.dtype, module.bias is None)
        if key in seen:
            continue
        seen.add(key)
        limit = min(max_logit_rows if name == "lm_head" else max_tokens, ROW_CHUNK)
        first = max(2 if module.weight_t is not None else 1, module.native_rows + 1)  # fewer: no oneDNN
        for rows in sorted({row_bucket(m) for m in range(first, limit + 1)}):
            module(torch.zeros(rows, w.shape[1], dtype=w.dtype))
            calls += 1
    return calls


class ConcatLinear(nn.Module):
    """Projections that could not be fused (mixed quantization schemes): outputs concatenated."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x):
        return torch.cat([p(x) for p in self.parts], dim=-1)


class DecoderLayer(nn.Module):
    """Pre-norm attention block and SwiGLU MLP with fused projections."""

    def __init__(self, spec: ModelSpec, dtype=None):
        super().__init__()
        h, qkv_out = spec.hidden_size, spec.q_size + 2 * spec.kv_size
        self.qkv = DenseLinear(h, qkv_out, dtype=dtype)  # placeholders: the loader swaps in the real ones
        self.o_proj = DenseLinear(spec.q_size, h, dtype=dtype)
        self.gate_up = DenseLinear(h, 2 * spec.intermediate_size, dtype=dtype)
        self.down = DenseLinear(spec.intermediate_size, h, dtype=dtype)
        self.register_buffer("input_norm", torch.empty(h, dtype=dtype))
        self.register_buffer("post_norm", torch.empty(h, dtype=dtype))
        self.eps, self.q_size, self.kv_size = spec.rms_norm_eps, spec.q_size, spec.kv_size
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim

    def forward(self, x, residual, attn, kv_cache):
        """x, residual [T, H] -> (mlp output, residual stream); residual None in the first layer."""
        ops = attn.op_backend
        if residual is None:
            h, residual = apply_norm(x, self.input_norm, self.eps, backend=ops), x
        else:
            h, residual = apply_norm(x, self.input_norm, self.eps, residual, ops)
        qkv = self.qkv(h)  # [T, (Hq + 2 Hk) * D]
        t, qs, ks = qkv.shape[0], self.q_size, self.kv_size
        q = qkv[:, :qs].view(t, self.heads, self.head_dim)  # [T, Hq, D]
        k = qkv[:, qs:qs + ks].view(t, self.kv_heads, self.head_dim)  # [T, Hk, D]
        v = qkv[:, qs + ks:].view(t, self.kv_heads, self.head_dim)
        attn.rotate(qkv[:, :qs + ks], q, k)
        o = attn.attend(q, k, v, qkv[:, qs:], kv_cache)  # [T, Hq, D]
        x = self.o_proj(o.reshape(t, qs))
        h, residual = apply_norm(x, self.post_norm, self.eps, residual, ops)
        return self.down(swiglu(self.gate_up(h), ops)), residual


class Runtime(nn.Module):
    """Embedding, decoder layers, final norm and lm_head (tied: the embedding matrix).

    The embedding is a dense table, or int8 codes [vocab, H] with group scales `embed_scale` [vocab, H/g]
    (`--embeddings int8`): a lookup dequantizes only the rows it reads, and a tied lm_head shares the codes.
    """

    def __init__(self, spec: ModelSpec, dtype=None):
        super().__init__()
        self.spec = spec
        self.register_buffer("embed_tokens", torch.empty(spec.vocab_size, spec.hidden_size, dtype=dtype))
        self.register_buffer("embed_scale", None)
        self.layers = nn.ModuleList(DecoderLayer(spec, dtype) for _ in range(spec.num_layers))
        self.register_buffer("norm", torch.empty(spec.hidden_size, dtype=dtype))
        self.lm_head = DenseLinear(spec.hidden_size, spec.vocab_size, dtype=dtype)
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

    def forward(self, token_ids, attn, kv_caches):
        """token_ids [T] -> (hidden, residual) [T, H] before the final norm. kv_caches: one cache per layer
        [num_blocks, block_size, 2, Hk, D], as a list or as the one tensor that stacks them (which lets a
        CPU decode step run every layer in one native call)."""
        x, residual = self.embed(token_ids), None  # [T, H]
        fused = self.native_decode if torch.is_tensor(kv_caches) and attn.op_backend == "cpu" else None
        if fused is not None:
            plan = attn.native_decode_plan(token_ids.shape[0], fused.max_rows, kv_caches.dtype)
            if plan is not None:
                cos_sin, slots, tables, lens, scale, block_size = plan
                out = fused.run(x, cos_sin, slots, kv_caches.view(kv_caches.shape[0], -1), tables, lens, scale,
                                block_size)
                return out, x  # x, the embeddings, now holds the residual stream
        for layer, kv_cache in zip(self.layers, kv_caches):  # kv_cache [num_blocks, block_size, 2, Hk, D]
            x, residual = layer(x, residual, attn, kv_cache)
        return x, residual

    @property
    def native_decode(self) -> "cpu_native.DecodeLayers | None":
        """Every decoder layer described for the native decode step (CPU, fp32/bf16, each projection on a
        native GEMV: dense, int4 or int8), built on first use; None where any part is missing (W8A8,
        mixed-scheme projections, tensor parallelism, no native library or no AVX-512)."""
        if getattr(self, "_native_decode", False) is False:
            self._native_decode = self._describe_native()
        return self._native_decode

    def _describe_native(self):
        if self.tp is not None or self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16) \
                or not cpu_native.gemv_available():
            return None
        layers, keep, rows = [], [], []
        for layer in self.layers:
            descs = [getattr(p, "native_desc", lambda: None)() for p in (layer.qkv, layer.o_proj, layer.gate_up,
                                                                         layer.down)]
            norms = (layer.input_norm, layer.post_norm)
            if any(d is None for d in descs) or any(n.dtype != self.dtype or not n.is_contiguous() for n in norms):
                return None
            layers.append((*[d[0] for d in descs], *norms))
            rows += [d[1] for d in descs]
            keep += [t for d in descs for t in d[2]] + list(norms)
        spec = self.spec
        return cpu_native.DecodeLayers(layers, self.dtype, spec.hidden_size, spec.num_heads, spec.num_kv_heads,
                                       spec.head_dim, spec.intermediate_size, spec.rms_norm_eps, keep, min(rows))

    def compute_logits(self, x, residual, indices, op_backend=None) -> torch.Tensor:
        """fp32 logits [R, vocab] of the rows `indices` only (final norm and lm_head skip the rest)."""
        h, _ = apply_norm(x.index_select(0, indices), self.norm, self.spec.rms_norm_eps,
                          residual.index_select(0, indices), op_backend)
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
