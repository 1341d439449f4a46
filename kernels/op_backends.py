"""The backends that run `llmopt.kernels`' ops as they are, on one explicit op backend:

- "triton" (`TritonBackend`): the Triton kernels, compiled on CUDA; on CPU tensors Triton's interpreter
  runs them (slow: that is how tests exercise the CUDA code path without a GPU).
- "reference" (`ReferenceBackend`): every op's torch twin (`*_ref`: exact fp32 dequantized matmuls,
  rms_norm_ref, paged_attention_ref, ...) on any device; the exact reference tests compare against.
Dense projections are plain `F.linear` on both (cuBLAS on CUDA).
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .activation import gelu_tanh_and_mul, silu_and_mul
from .kv_cache import write_kv_cache
from .linear import QUANTIZED
from .norm import rms_norm
from .paged_attention import StepMetadata, paged_attention_decode, paged_attention_prefill
from .rotary import apply_rotary


class TorchLinear(nn.Module):
    """`F.linear(x, weight, bias)` on a plain (possibly fused) weight [N, K]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class KernelAttention:
    """RoPE, cache writes and paged attention by the ops of `llmopt.kernels` on one op backend; `window`: the
    sliding window in keys (None: full causal)."""

    def __init__(self, meta: StepMetadata, cos_sin_cache: torch.Tensor, scale: float, op_backend: str,
                 window: int | None = None):
        self.meta, self.cos_sin_cache, self.scale, self.op_backend = meta, cos_sin_cache, scale, op_backend
        self.window = window

    def rotate(self, qk, q, k):
        """Rotate q [T, Hq, D] and k [T, Hk, D] in place (views of `qk`, the q||k part of the projection)."""
        apply_rotary(q, k, self.meta.positions, self.cos_sin_cache, backend=self.op_backend)

    def attend(self, q, k, v, kv, kv_cache):
        """Write k, v [T, Hk, D] into the cache [blocks, block_size, 2, Hk, D], then attention of q [T, Hq, D]."""
        b, meta = self.op_backend, self.meta
        k_cache, v_cache = kv_cache[:, :, 0], kv_cache[:, :, 1]  # [num_blocks, block_size, Hk, D], shared strides
        if not meta.is_decode:
            return paged_attention_prefill(q, k, v, k_cache, v_cache, meta, self.scale, backend=b, window=self.window)
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, backend=b)
        return paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale,
                                      backend=b, window=self.window)


class OpBackend:
    """A backend whose every op is `llmopt.kernels`' op on `op_backend` ("triton" or "torch")."""

    name = ""
    op_backend = ""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={str(self.device)!r})"

    def dense_linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
        """A projection over a dense weight [N, K]."""
        return TorchLinear(weight, bias)

    def quantized_linear(self, fmt: str, tensors: Mapping[str, torch.Tensor], group_size: int | None = None,
                         bias: torch.Tensor | None = None) -> nn.Module:
        """A projection over compressed-tensors tensors of format "w4a16", "w8a16" or "w8a8"."""
        layer = QUANTIZED[fmt].from_compressed(tensors, group_size, bias)
        return layer.route(layer.op_kernel(self.op_backend))

    def rms_norm(self, x, weight, eps, residual=None):
        """RMSNorm of x, or of x + residual, then returning (out, that sum)."""
        return rms_norm(x, weight, eps, residual, backend=self.op_backend)

    def silu_and_mul(self, x):
        """silu(gate) * up on the fused gate||up rows [T, 2I] -> [T, I]."""
        return silu_and_mul(x, backend=self.op_backend)

    def gelu_tanh_and_mul(self, x):
        """gelu(gate, approximate="tanh") * up on the fused gate||up rows [T, 2I] -> [T, I]."""
        return gelu_tanh_and_mul(x, backend=self.op_backend)

    def attention(self, meta: StepMetadata, cos_sin_cache, scale: float, block_size: int, dtype,
                  window: int | None = None) -> KernelAttention:
        """The step's attention (RoPE, cache writes, paged attention), planned once from `meta`; `window`: each
        query sees only the last `window` positions up to its own (None: every one)."""
        return KernelAttention(meta, cos_sin_cache, scale, self.op_backend, window)

    def fused_decode(self, layers) -> None:
        """No fused decode step here: layers run one by one."""
        return None

    def prebuild(self, model: nn.Module, max_tokens: int, max_logit_rows: int) -> int:
        """Nothing to build ahead: returns 0 calls."""
        return 0


class TritonBackend(OpBackend):
    """The Triton kernels (compiled on CUDA, interpreted on CPU tensors)."""

    name, op_backend = "triton", "triton"


class ReferenceBackend(OpBackend):
    """Every op's exact torch twin, on any device."""

    name, op_backend = "reference", "torch"
