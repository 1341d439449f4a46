"""One Backend per device, chosen once, when the runtime is loaded: the one place the route is decided.

| name | where | what runs |
|---|---|---|
| cpu-native | CPU | our C kernels (AVX-512 GEMVs, paged decode, norms, the fused decode step) beside torch's |
| cpu-torch | CPU | torch's CPU kernels (oneDNN, MKL, packed int4/int8, fbgemm, SDPA) |
| triton | CUDA (CPU: interpreted) | the Triton kernels of `llmopt.kernels`; dense projections on cuBLAS |
| reference | any | every op's exact torch twin (`*_ref`): what the tests compare against |

"auto" picks triton on a CUDA device (reference where triton is not installed) and, on CPU,
cpu-native where the native library builds with its AVX-512 GEMVs and the dtype is fp32/bf16 (or not
given), else cpu-torch. A name that cannot run here raises KernelBackendError with the reason.

A backend owns everything whose kernel depends on the device: it builds each projection module from
the loaded tensors (`dense_linear`, `quantized_linear`: the module's kernels are fixed then, see
`linear.RoutedLinear`), runs the norm and the gated activations (SwiGLU, GeGLU), builds each step's
attention object (RoPE, cache writes and paged attention, planned once per step from its `StepMetadata`,
with a sliding window where the layer has one), builds the fused whole-model decode step where it has
one, and prebuilds per-shape matmul primitives where they exist (CPU oneDNN row buckets). The model code
calls these and nothing else device-specific.
"""
from __future__ import annotations

from typing import Mapping, Protocol, Sequence

import torch
from torch import nn

from . import BACKENDS
from ._backend import KernelBackendError, available as triton_available
from .cpu_backends import CpuNativeBackend, CpuTorchBackend, unavailable_reason
from .op_backends import ReferenceBackend, TritonBackend
from .paged_attention import StepMetadata



class StepAttention(Protocol):
    """A step's attention: every layer calls `rotate`, then `attend`."""

    def rotate(self, qk: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """RoPE on q [T, Hq, D] and k [T, Hk, D] in place; qk [T, (Hq + Hk) * D] is the fused q||k they view."""

    def attend(self, q, k, v, kv: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """Write k||v (`kv` [T, 2 * Hk * D], k and v [T, Hk, D] its views) into the layer's cache
        [blocks, block_size, 2, Hk, D], then attention of q [T, Hq, D]; returns [T, Hq, D]."""


class Backend(Protocol):
    """What a backend provides (see the module docstring); `name` is one of BACKENDS but "auto"."""

    name: str
    device: torch.device

    def dense_linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
        """A projection over a dense weight [N, K] (possibly several Linears' weights concatenated)."""

    def quantized_linear(self, fmt: str, tensors: Mapping[str, torch.Tensor], group_size: int | None = None,
                         bias: torch.Tensor | None = None) -> nn.Module:
        """A projection over one Linear's compressed-tensors tensors; fmt "w4a16", "w8a16" or "w8a8";
        group_size -1: one group per output channel, None: inferred from the scales."""

    def rms_norm(self, x, weight, eps, residual=None):
        """RMSNorm of x [T, H], or of x + residual, then returning (out, that sum: the new residual stream)."""

    def silu_and_mul(self, x):
        """silu(gate) * up on the fused gate||up rows [T, 2I] -> [T, I]."""

    def gelu_tanh_and_mul(self, x):
        """gelu(gate, approximate="tanh") * up on the fused gate||up rows [T, 2I] -> [T, I] (GeGLU: Gemma's MLP)."""

    def attention(self, meta: StepMetadata, cos_sin_cache: torch.Tensor, scale: float, block_size: int,
                  dtype: torch.dtype, window: int | None = None) -> StepAttention:
        """The attention object of one step, planned once from `meta`. `window`: sliding-window attention, a
        query at position p sees the keys p - window < k <= p (transformers' `sliding_window_overlay`), and
        cache rows older than every query's window are never read (their blocks may have been freed);
        None: full causal attention."""

    def fused_decode(self, layers: Sequence) -> object | None:
        """The whole-model decode step built from the decoder layers, or None where this backend has none.
        Called as `fused(x, attn, kv_caches)`: (out, residual), or None when it does not take the step."""

    def prebuild(self, model: nn.Module, max_tokens: int, max_logit_rows: int) -> int:
        """Build the per-shape matmul primitives a step can need now; returns the number of calls made."""


def select_backend(name: str = "auto", device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> Backend:
    """The backend `name` for `device` and the model's `dtype` (None: not known yet).

    KernelBackendError, with a one-line reason, for an unknown name or one that cannot run here
    ("cpu-native: native kernels not built: no C compiler (gcc or cc) on PATH").
    """
    device = torch.device(device)
    if name == "auto":
        name = _auto(device, dtype)
    if name in ("cpu-native", "cpu-torch"):
        cls = CpuNativeBackend if name == "cpu-native" else CpuTorchBackend
        return cls(device, dtype)
    if name == "triton":
        if not triton_available():
            raise KernelBackendError("triton: the triton package is not installed (pip install triton)")
        return TritonBackend(device)
    if name == "reference":
        return ReferenceBackend(device)
    raise KernelBackendError(f"unknown backend {name!r}; use one of {', '.join(BACKENDS)}")


def _auto(device: torch.device, dtype: torch.dtype | None) -> str:
    if device.type == "cuda":
        return "triton" if triton_available() else "reference"
    if device.type != "cpu":
        return "reference"
    return "cpu-native" if unavailable_reason(dtype) is None else "cpu-torch"
