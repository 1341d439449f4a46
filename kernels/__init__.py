"""Compute layer: every kernel (Triton for CUDA, C and torch for CPU) with its torch twin and its policy, and
one `Backend` per device that the serve runtime is built with.

Backends (`backend.py`; `select_backend(name="auto", device="cpu", dtype=None)` is the one place the route
is chosen; "auto" | "cpu-native" | "cpu-torch" | "triton" | "reference"):
    cpu-native  our C kernels (`cpu_native`: AVX-512 GEMVs, paged decode, norm/SwiGLU/RoPE, the fused decode
                step) beside torch's CPU kernels for what they do not take
    cpu-torch   torch's CPU kernels: oneDNN on row buckets, MKL, packed int4/int8 (`cpu_quant`), fbgemm, SDPA
    triton      the Triton kernels below, compiled on CUDA; on CPU tensors Triton's interpreter (tests)
    reference   every op's `*_ref` torch twin, on any device: the exact reference tests compare against
A backend builds the projection modules from loaded tensors (`dense_linear`, `quantized_linear`: each
module's kernels are fixed then), runs `rms_norm`, `silu_and_mul` and `gelu_tanh_and_mul`, builds a step's
`attention` from its `StepMetadata` (and the layer's sliding `window`), the `fused_decode` step where it has
one, and `prebuild`s per-shape matmul primitives.

Ops. Each takes `backend=None|"triton"|"torch"`: "torch" runs the op's `*_ref` twin, "triton" the kernel
(interpreted on CPU tensors), None picks from the tensor's device (CUDA -> Triton, else the twin). The
backends above always pass one explicitly. Importing this package is cheap: submodules, torch and triton
load on first attribute access.

Elementwise / norms
    rms_norm(x, weight, eps=1e-6, residual=None, backend=None) -> out | (out, x + residual)
        Triton path updates `residual` in place and returns it.
    silu_and_mul(x, backend=None)              x [..., 2I] = gate||up -> [..., I]
    gelu_tanh_and_mul(x, backend=None)         x [..., 2I] = gate||up -> gelu(gate, approximate="tanh") * up
    apply_rotary(q, k, positions, cos_sin_cache, is_neox=True, backend=None) -> (q, k), in place
    build_cos_sin_cache(head_dim, max_positions, theta=1e4, rope_scaling=None, rotary_dim=None)
        -> [max_positions, rotary_dim] = cos || sin; rope_scaling: HF dict, types default/linear/llama3

Quantized matmuls (compressed-tensors layout; x [..., K] -> [..., N] in x's dtype; group_size -1:
one group per output channel, None: inferred from the scales)
    w4a16_matmul(x, weight_packed, weight_scale, weight_zero_point=None, group_size=None, backend=None)
        weight_packed int32 [N, ceil(K/8)] (col 8c+j in bits 4j of word c, stored q+8),
        weight_scale [N, G], weight_zero_point int32 [ceil(N/8), G] packed along N, stored zp+8.
    w8a16_matmul(x, weight, weight_scale, weight_zero_point=None, group_size=None, backend=None)
        weight int8 [N, K]; weight_scale [N, G]; weight_zero_point int8 [N, G].
        On "triton" both run the decode GEMV (`wq_gemv`: weight streamed as the dot's A operand, 16-byte
        cp.async, K slices stacked / split from the SM count, `plan_gemv`) for up to 16 rows of x, the
        tiled kernel above; both read each packed word once.
    w8a8_matmul(x, weight, weight_scale, backend=None)     int8 [N, K] x per-token int8 activations
    quantize_per_token(x, backend=None) -> (int8 [M, K], fp32 scale [M])
    dequantize(q, weight_scale, zero=None, group_size=None, dtype=fp32) -> (q - zero) * scale [N, K]: the one
        dequantizer; w4a16_dequantize(...) the same from the packed int4 layout

Layers (`nn.Module`)
    W4A16Linear, W8A16Linear, W8A8Linear: `from_compressed(tensors, group_size, bias)`, the exact twin until
        a backend routes them (`Backend.quantized_linear`)
    ColumnParallelLinear(inner, group=None, gather_output=False), RowParallelLinear(inner, group, bias)
    shard(tensor, dim, rank, world), world_size(group)

Paged KV cache: k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim];
slot = block * block_size + offset; block_tables [S, max_blocks] int32; context_lens [S] int32
counts cached tokens *including* the ones being computed.
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, backend=None)          slot < 0: skipped
    paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, backend=None, window=None)
    paged_attention_prefill(q, k, v, k_cache, v_cache, meta: StepMetadata, scale, backend=None, window=None)
        writes k/v by meta.slot_mapping, then causal attention of packed q (meta.cu_seqlens_q)
        over each sequence's cache: cached prefix + new tokens (chunked prefill, shared prefixes).
        window: sliding window, a query at p sees keys p - window < k <= p; rows before it are never read.

Native CPU kernels (`cpu_native`: C in `csrc/`, built with gcc at first use; `available()`/`why_unavailable()`)
    cpu_native.paged_decode(q, kv_rows, block_tables, context_lens, scale, block_size, window=None)
        decode attention read in place from a layer's cache rows [slots, K || V]; fp32 / bf16
    cpu_native.gemv(x, DenseWeight(w), bias) / gemv_w4(x, Int4Weight(q, scales, zeros, group), bias)
        / gemv_w8(x, Int8Weight(q, scales, zeros, group), bias)
        decode-sized matmuls (AVX-512) on weights tiled once at load time, streamed once per call;
        batch-invariant; fp32 arithmetic (W4A16 and W8A16 too: with AVX512-VNNI, csrc/gemv_vnni.c, integer
        dot products on x held as a 24-bit fixed point per block of inputs)
    cpu_native.add_rms_norm / silu_mul / gelu_tanh_mul / rope_: a layer's small ops, one call each
    cpu_native.DecodeLayers(...).run(...): every decoder layer of a decode step in one call (`fused_decode`)
    cpu_prefill.prefill_matmul(x, pack_w4a16_prefill(...) / pack_w8a16_prefill(...))
        prefill-sized W4A16/W8A16 matmuls: AMX on panels dequantized into tile layout (`csrc/amx_wq.c`), else
        a bf16 scratch dequantized natively (`csrc/dequant.c`) + oneDNN; bf16 activations, fp32 sums
CPU policy: `cpu_linear` (DenseLinear, oneDNN row buckets and their prebuild), `cpu_attention` (paged
attention and decode grouping), `cpu_quant` (torch's packed kernels and their numerics: bf16 activations
for W4A16/W8A16, fbgemm per-token int8 for W8A8), `layout_cache` (the layouts built at load time, stored
once per model and read back by mmap: `cached_layout(kind, build)` under a `LayoutCache.scope(name)`).

Errors: ValueError for wrong shapes/dtypes (message says what was expected);
KernelBackendError for a backend that cannot run here.
"""
from __future__ import annotations

import importlib
import sys


def _defer_to_installed_kernels() -> None:
    """Imported as a top-level `kernels`, this folder is shadowing another distribution.

    In a checkout, `python -m ...`, pytest (tests/ is a package) and some scripts put the repository
    root on sys.path, so `import kernels` finds this folder. transformers >= 5.25 imports the PyPI
    `kernels` package (Hugging Face's kernel hub) whenever it is installed; finding ours there breaks
    every transformers import. We install only as `llmopt.kernels`, so a top-level import is never
    meant for us: load the installed package in our place. Where none is installed, the import yields an
    empty module (no `__file__`, no names): transformers imports `kernels` as soon as `find_spec` sees a
    folder of that name and does not catch ModuleNotFoundError there, while `from kernels import X` still
    fails as an import of a missing name, which its optional-dependency guards do catch.
    """
    import types
    import importlib.machinery
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    path = [p for p in sys.path if Path(p or ".").resolve() != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        sys.modules["kernels"] = types.ModuleType("kernels", "placeholder: no `kernels` distribution is installed")
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # the import statement returns sys.modules["kernels"]
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _defer_to_installed_kernels()

_EXPORTS = {
    "rms_norm": "norm", "rms_norm_ref": "norm",
    "silu_and_mul": "activation", "silu_and_mul_ref": "activation",
    "gelu_tanh_and_mul": "activation", "gelu_tanh_and_mul_ref": "activation",
    "apply_rotary": "rotary", "apply_rotary_ref": "rotary", "build_cos_sin_cache": "rotary",
    "w4a16_matmul": "wq_matmul", "w4a16_matmul_ref": "wq_matmul", "w4a16_dequantize": "wq_matmul",
    "dequantize": "wq_matmul",
    "w8a16_matmul": "wq_matmul", "w8a16_matmul_ref": "wq_matmul",
    "w8a8_matmul": "w8a8", "w8a8_matmul_ref": "w8a8", "quantize_per_token": "w8a8",
    "W4A16Linear": "linear", "W8A16Linear": "linear", "W8A8Linear": "linear",
    "ColumnParallelLinear": "parallel", "RowParallelLinear": "parallel", "shard": "parallel",
    "world_size": "parallel",
    "write_kv_cache": "kv_cache", "write_kv_cache_ref": "kv_cache",
    "paged_attention_decode": "paged_attention", "paged_attention_prefill": "paged_attention",
    "paged_attention_ref": "paged_attention", "paged_attention_decode_ref": "paged_attention",
    "StepMetadata": "paged_attention",
    "KernelBackendError": "_backend",
    "Backend": "backend", "select_backend": "backend",
}
# The backends' names, here rather than in backend.py so that a config can check a --backend value
# without importing torch.
BACKENDS = ("auto", "cpu-native", "cpu-torch", "triton", "reference")

__all__ = sorted([*_EXPORTS, "BACKENDS"])


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
