"""The CPU backends: "cpu-torch" (torch's CPU kernels) and "cpu-native" (ours, C in `csrc/`, beside them).

Every projection gets its kernels here, once, at load time (see `linear.RoutedLinear`):

| projection | cpu-torch | cpu-native |
|---|---|---|
| dense fp32 | MKL on W.T for 1 row, oneDNN beyond | native GEMV up to GEMV_MAX_ROWS, oneDNN beyond |
| dense bf16 | oneDNN | native GEMV up to GEMV_MAX_ROWS, oneDNN beyond |
| W4A16 | torch's int4 kernel, the prefill kernel from 16 rows; else a dense copy | native GEMV up to W4_MAX_ROWS, then as cpu-torch or (no torch kernel) the prefill kernel |
| W8A16 | torch's int8 kernel, the prefill kernel from 16 rows; else a dense copy | native GEMV up to W8_MAX_ROWS, then as cpu-torch or (no torch kernel) the prefill kernel |
| W8A8 | fbgemm, else the exact twin | as cpu-torch |

"the prefill kernel": `cpu_prefill` (AMX, else a dequantized bf16 scratch + oneDNN), no copy of the weight.
"a dense copy": no torch CPU kernel takes the layout (group-wise int8, odd shapes), and the exact twin
would dequantize the whole weight on every call (~8x slower than dense here), so it is dequantized once:
as the layer itself (cpu-torch, or cpu-native where the GEMV cannot take it either), or as the layer's
`dense` fallback beyond the GEMV's rows. oneDNN calls run on row buckets (`cpu_linear`). Norms,
SwiGLU/GeGLU, RoPE and decode attention are torch ops on cpu-torch and native calls on cpu-native, which also
fuses a whole decode step (`fused_decode`).
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_native, cpu_prefill, cpu_quant
from ._backend import KernelBackendError
from .cpu_attention import GROUP_OVERHEAD_KEYS, CpuAttention, NativeCpuAttention
from .cpu_linear import DenseLinear, NativeLinear, prebuild_row_buckets
from .fused_decode import FusedDecode
from .layout_cache import cached_layout
from .linear import QUANTIZED, QuantLinear, W4A16Linear, W8A16Linear
from .paged_attention import StepMetadata
from .wq_matmul import dequantize, unpack_int4_stored, unpack_zero_point_stored, w4a16_dequantize

_TORCH_KERNELS = {  # format -> (pack the layer for torch's CPU kernel or None, run it)
    "w4a16": (lambda l: cpu_quant.pack_w4a16_for_cpu(l.weight_packed, l.weight_scale, l.in_features,
                                                     l.weight_zero_point, l.group_size), cpu_quant.w4a16_cpu_matmul),
    "w8a16": (lambda l: cpu_quant.pack_w8a16_for_cpu(l.weight, l.weight_scale, l.weight_zero_point),
              cpu_quant.w8a16_cpu_matmul),
    "w8a8": (lambda l: cpu_quant.pack_w8a8_for_cpu(l.weight, l.weight_scale), cpu_quant.w8a8_cpu_matmul),
}


DEQUANT_ROWS = 4096  # output rows dequantized at once (a multiple of 8: W4 zero points pack 8 rows a word)


def dequantized(layer: QuantLinear, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense weight [N, K] = (q - zero) * scale that a weight-only quantized layer represents, in `dtype`
    (computed in fp32, then rounded). Made DEQUANT_ROWS rows at a time: a whole large weight's fp32
    intermediates (an lm_head's: several times its dense size) would set the process's peak memory."""
    n = layer.out_features
    out = torch.empty(n, layer.in_features, dtype=dtype, device=layer.weight_scale.device)
    for start in range(0, n, DEQUANT_ROWS):
        end = min(n, start + DEQUANT_ROWS)
        zero = layer.weight_zero_point
        if isinstance(layer, W4A16Linear):
            zero = None if zero is None else zero[start // 8:-(-end // 8)]
            out[start:end] = w4a16_dequantize(layer.weight_packed[start:end], layer.weight_scale[start:end],
                                              layer.in_features, zero, layer.group_size)
        else:
            out[start:end] = dequantize(layer.weight[start:end], layer.weight_scale[start:end],
                                        None if zero is None else zero[start:end], layer.group_size)
    return out


class CpuTorchBackend:
    """torch's CPU kernels (oneDNN, MKL, the packed int4/int8 kernels, fbgemm, SDPA).

    dtype: the activations' dtype, in which dense copies of quantized weights are made (None: fp32);
    group_overhead_keys: a batched decode attention call's fixed cost in keys (see `decode_groups`).
    """

    name = "cpu-torch"

    def __init__(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                 group_overhead_keys: int = GROUP_OVERHEAD_KEYS):
        self.device = torch.device(device)
        if self.device.type != "cpu":
            raise KernelBackendError(f"{self.name}: runs on CPU only, not on {self.device}; use triton or reference")
        self.dtype, self.group_overhead_keys = dtype, group_overhead_keys

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dtype={self.dtype}, group_overhead_keys={self.group_overhead_keys})"

    def dense_linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
        """A projection over a dense weight [N, K]."""
        return DenseLinear(weight, bias).prepare(native=False)

    def quantized_linear(self, fmt: str, tensors: Mapping[str, torch.Tensor], group_size: int | None = None,
                         bias: torch.Tensor | None = None) -> nn.Module:
        """A projection over compressed-tensors tensors of format "w4a16", "w8a16" or "w8a8"."""
        return self._torch_route(fmt, QUANTIZED[fmt].from_compressed(tensors, group_size, bias))

    def _torch_route(self, fmt: str, layer: QuantLinear) -> nn.Module:
        kernel = self._torch_kernel(fmt, layer)
        if kernel is not None:
            return layer.route(kernel)
        if fmt == "w8a8":  # no fbgemm in this torch build: the exact twin
            return layer
        return self.dense_linear(dequantized(layer, self.dtype or torch.float32), layer.bias)

    @staticmethod
    def _torch_kernel(fmt: str, layer: QuantLinear):
        """torch's CPU kernel for the layer (its layout kept as `cpu_weight`), or None where none takes it."""
        pack, run = _TORCH_KERNELS[fmt]
        layer.cpu_weight = cached_layout("torch", lambda: pack(layer), keep=dict(layer.named_buffers(recurse=False)))
        if layer.cpu_weight is None:
            return None
        return lambda x: layer.add_bias(run(x, layer.cpu_weight))

    def rms_norm(self, x, weight, eps, residual=None):
        """RMSNorm of x, or of x + residual, then returning (out, that sum): torch's fused rms_norm, measured
        ~25 % faster than the kernels' fp32 twin at decode sizes."""
        if residual is None:
            return F.rms_norm(x, weight.shape, weight, eps)
        residual = x + residual
        return F.rms_norm(residual, weight.shape, weight, eps), residual

    def silu_and_mul(self, x):
        """silu(gate) * up on the fused gate||up rows [T, 2I] -> [T, I]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def gelu_tanh_and_mul(self, x):
        """gelu(gate, approximate="tanh") * up on the fused gate||up rows [T, 2I] -> [T, I]."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)

    def attention(self, meta: StepMetadata, cos_sin_cache, scale: float, block_size: int, dtype,
                  window: int | None = None) -> CpuAttention:
        """The step's attention (RoPE, cache writes, paged attention), planned once from `meta`; `window`: each
        query sees only the last `window` positions up to its own (None: every one)."""
        return CpuAttention(meta, cos_sin_cache, scale, block_size, dtype, self.group_overhead_keys, window)

    def fused_decode(self, layers) -> FusedDecode | None:
        """No fused decode step on torch's kernels: layers run one by one."""
        return None

    def prebuild(self, model: nn.Module, max_tokens: int, max_logit_rows: int) -> int:
        """Build oneDNN's per-shape primitives for every row bucket now (`cpu_linear.prebuild_row_buckets`)."""
        return prebuild_row_buckets(model, max_tokens, max_logit_rows)


class CpuNativeBackend(CpuTorchBackend):
    """Our native CPU kernels (AVX-512 GEMVs, paged decode, norm/SwiGLU/RoPE, the fused decode step), with
    torch's beside them for what they do not take (more rows, W8A8, prefill attention)."""

    name = "cpu-native"

    def __init__(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                 group_overhead_keys: int = GROUP_OVERHEAD_KEYS):
        super().__init__(device, dtype, group_overhead_keys)
        reason = unavailable_reason(dtype)
        if reason is not None:
            raise KernelBackendError(f"{self.name}: {reason}")

    def dense_linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
        return DenseLinear(weight, bias).prepare(native=True)

    def quantized_linear(self, fmt: str, tensors: Mapping[str, torch.Tensor], group_size: int | None = None,
                         bias: torch.Tensor | None = None) -> nn.Module:
        layer = QUANTIZED[fmt].from_compressed(tensors, group_size, bias)
        native = native_linear(layer)
        if native is None:
            return self._torch_route(fmt, layer)
        # Beyond the GEMV's rows. W4 on AMX: the AMX prefill kernel for every row count, so torch's int4 layout
        # (a third copy of the weight, beside the compressed tensors and the GEMV's tiles) is never made; it is
        # level with torch's kernel at 8-16 rows and ahead from there (without AMX the prefill path dequantizes
        # the whole weight per call, too slow for a few rows). W8: torch's kernel reads the int8 weight itself
        # (no copy) and is the quicker below PREFILL_MIN_ROWS_W8.
        on_amx = isinstance(layer, W4A16Linear) and cpu_prefill.amx_available()
        first = prefill_kernel(layer, amx_only=True) if on_amx else None
        large = first or self._torch_kernel(fmt, layer) or prefill_kernel(layer)
        if large is None:  # beyond the GEMV's rows: a dense copy, on oneDNN (which alone keeps it)
            layer.dense = DenseLinear(dequantized(layer, self.dtype or torch.float32), layer.bias).prepare(
                False, above_rows=native.max_rows)
            large = layer.dense.forward
        layer.native = native
        return layer.route(large, native, native.max_rows)

    def rms_norm(self, x, weight, eps, residual=None):
        if cpu_native.ops_supported(x.dtype) and x.dim() == 2 and x.stride(1) == 1 and weight.dtype == x.dtype \
                and (residual is None or residual.stride(1) == 1):
            return cpu_native.add_rms_norm(x, weight, eps, residual)  # the residual is updated in place
        return super().rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x):
        if cpu_native.ops_supported(x.dtype) and x.dim() == 2 and x.stride(-1) == 1:
            return cpu_native.silu_mul(x)
        return super().silu_and_mul(x)

    def gelu_tanh_and_mul(self, x):
        if cpu_native.ops_supported(x.dtype) and x.dim() == 2 and x.stride(-1) == 1:
            return cpu_native.gelu_tanh_mul(x)
        return super().gelu_tanh_and_mul(x)

    def attention(self, meta: StepMetadata, cos_sin_cache, scale: float, block_size: int, dtype,
                  window: int | None = None) -> CpuAttention:
        return NativeCpuAttention(meta, cos_sin_cache, scale, block_size, dtype, self.group_overhead_keys, window)

    def fused_decode(self, layers) -> FusedDecode | None:
        """Every decoder layer of a decode step in one native call, where each part has a native form."""
        return FusedDecode.build(list(layers))


def unavailable_reason(dtype: torch.dtype | None = None) -> str | None:
    """Why "cpu-native" cannot run here for `dtype` (None: any dtype it takes), or None when it can."""
    if not cpu_native.available():
        return f"native kernels not built: {cpu_native.why_unavailable()}"
    if not cpu_native.gemv_available():
        return "the native GEMVs need an AVX-512 CPU, which this is not; use cpu-torch"
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16):
        return f"native kernels take fp32 or bf16, not {str(dtype).removeprefix('torch.')}; use cpu-torch"
    return None


def native_linear(layer: QuantLinear) -> NativeLinear | None:
    """The native GEMV of a weight-only quantized layer, or None where its layout has none (W8A8, group
    sizes the GEMV does not take)."""
    n, k, group = layer.out_features, layer.in_features, getattr(layer, "group_size", None)
    if isinstance(layer, W4A16Linear) and cpu_native.Int4Weight.supports(k, group):
        zeros = None if layer.weight_zero_point is None else unpack_zero_point_stored(layer.weight_zero_point, n)
        weight = cached_layout("native", lambda: cpu_native.Int4Weight(
            unpack_int4_stored(layer.weight_packed, k), layer.weight_scale.reshape(n, -1), zeros, group))
        return NativeLinear(weight, layer.bias, cpu_native.W4_MAX_ROWS)
    if isinstance(layer, W8A16Linear) and layer.weight.dtype == torch.int8 \
            and cpu_native.Int8Weight.supports(k, group):
        weight = cached_layout("native", lambda: cpu_native.Int8Weight(layer.weight, layer.weight_scale.reshape(n, -1),
                                                                        layer.weight_zero_point, group))
        return NativeLinear(weight, layer.bias, cpu_native.W8_MAX_ROWS)
    return None


def prefill_kernel(layer: QuantLinear, amx_only: bool = False):
    """The native prefill GEMM of a weight-only layer (`cpu_prefill.prefill_matmul`: AMX tiles, or the weight
    dequantized per call into a bf16 scratch then a bf16 GEMM), instead of a dense copy kept for good; None
    where it does not take the layout (amx_only: or would not run on AMX)."""
    if isinstance(layer, W4A16Linear):
        weight = cpu_prefill.pack_w4a16_prefill(layer.weight_packed, layer.weight_scale, layer.in_features,
                                              layer.weight_zero_point, layer.group_size)
    elif isinstance(layer, W8A16Linear):
        weight = cpu_prefill.pack_w8a16_prefill(layer.weight, layer.weight_scale, layer.weight_zero_point,
                                              layer.group_size)
    else:
        return None
    if weight is None or (amx_only and weight.amx is None):
        return None
    return lambda x: layer.add_bias(cpu_prefill.prefill_matmul(x, weight))
