"""Quantized linear layers for the serve engine, built from compressed-tensors tensors.

`from_compressed(tensors, ...)` takes one Linear's tensors as they sit in the safetensors file
(names without the module prefix, e.g. {"weight_packed", "weight_scale", "weight_shape"}).
The compressed-tensors layout is kept as buffers (the Triton path reads it directly); on CPU
the weight is additionally converted once into the layout of the fastest CPU kernel
(`cpu_quant`). `forward` then picks: CUDA -> Triton, CPU -> that kernel, or the torch twin
when the CPU kernel cannot take the shape. `backend="torch"|"triton"` forces one path.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from . import cpu_native, cpu_quant
from ._backend import check
from .w8a8 import w8a8_matmul
from .wq_matmul import resolve_group_size, unpack_int4_stored, unpack_zero_point_stored, w4a16_matmul, w8a16_matmul


class _QuantLinear(nn.Module):
    """Shared plumbing: bias, backend override, CPU pack selection."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, backend: str | None):
        super().__init__()
        self.in_features, self.out_features, self.backend = in_features, out_features, backend
        self.register_buffer("bias", bias)
        self.cpu_weight = None  # set by prepare_cpu(); a plain attribute, rebuilt after loading
        self.native = self.bias_f32 = None  # the native GEMV's layout, where a subclass has one
        self.dense = None  # CPU: a dense (dequantized) twin for calls the native GEMV does not take, if any

    def _use_cpu_kernel(self, x: torch.Tensor) -> bool:
        return self.backend is None and x.device.type == "cpu" and self.cpu_weight is not None

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        path = type(self.cpu_weight).__name__ if self.cpu_weight is not None else "reference"
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, cpu={path}"


class W4A16Linear(_QuantLinear):
    """int4 weight-only linear (pack-quantized, group-wise or channel-wise, sym or asym)."""

    def __init__(self, weight_packed, weight_scale, in_features, weight_zero_point=None, group_size=None,
                 bias=None, backend=None):
        super().__init__(in_features, weight_packed.shape[0], bias, backend)
        self.register_buffer("weight_packed", weight_packed)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight_zero_point", weight_zero_point)
        self.group_size = group_size

    @classmethod
    def from_compressed(cls, tensors: Mapping[str, torch.Tensor], group_size=None, bias=None, backend=None):
        """Build from {weight_packed, weight_scale, weight_shape[, weight_zero_point]}."""
        out_features, in_features = (int(v) for v in tensors["weight_shape"].tolist())
        check(tensors["weight_packed"].shape[0] == out_features,
              "W4A16Linear: weight_shape disagrees with weight_packed")
        layer = cls(tensors["weight_packed"], tensors["weight_scale"], in_features,
                    tensors.get("weight_zero_point"), group_size, bias, backend)
        return layer.prepare_cpu()

    def prepare_cpu(self):
        """Convert once to the int4 CPU kernels' layouts (no-op off CPU or for unsupported shapes): the native
        GEMV's for decode-sized calls (fp32 activations), torch's packed int4 kernel for the rest."""
        self.cpu_weight = cpu_quant.pack_w4a16_for_cpu(
            self.weight_packed, self.weight_scale, self.in_features, self.weight_zero_point, self.group_size)
        self.native = self.bias_f32 = None
        group = resolve_group_size(self.in_features, self.weight_scale, self.group_size)
        if self.weight_packed.device.type == "cpu" and cpu_native.Int4Weight.supports(self.in_features, group) \
                and cpu_native.gemv_available():
            zeros = None if self.weight_zero_point is None \
                else unpack_zero_point_stored(self.weight_zero_point, self.out_features)
            self.native = cpu_native.Int4Weight(unpack_int4_stored(self.weight_packed, self.in_features),
                                                self.weight_scale.reshape(self.out_features, -1), zeros, group)
            self.bias_f32 = None if self.bias is None else self.bias.float().contiguous()
        return self

    def native_desc(self):
        """(C description, most rows it serves, tensors to keep) for the fused native decode step, or None."""
        if self.native is None or self.backend is not None:
            return None
        return cpu_native.linear_desc(self.native, self.bias_f32), cpu_native.W4_MAX_ROWS, [self.native, self.bias_f32]

    def forward(self, x):
        if self.native is not None and self.backend is None and x.device.type == "cpu" and x.dim() == 2 \
                and x.shape[0] <= cpu_native.W4_MAX_ROWS:
            return cpu_native.gemv_w4(x if x.stride(1) == 1 else x.contiguous(), self.native, self.bias_f32)
        if self.dense is not None and self.backend is None and x.device.type == "cpu":
            return self.dense(x)
        if self._use_cpu_kernel(x):
            return self._finish(cpu_quant.w4a16_cpu_matmul(x, self.cpu_weight))
        y = w4a16_matmul(x, self.weight_packed, self.weight_scale, self.weight_zero_point, self.group_size,
                         backend=self.backend)
        return self._finish(y)


class W8A16Linear(_QuantLinear):
    """int8 weight-only linear: int8 `weight` [N, K], `weight_scale` [N, G], optional zero point."""

    def __init__(self, weight, weight_scale, weight_zero_point=None, group_size=None, bias=None, backend=None):
        super().__init__(weight.shape[1], weight.shape[0], bias, backend)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight_zero_point", weight_zero_point)
        self.group_size = group_size

    @classmethod
    def from_compressed(cls, tensors: Mapping[str, torch.Tensor], group_size=None, bias=None, backend=None):
        """Build from {weight (int8), weight_scale[, weight_zero_point]}."""
        layer = cls(tensors["weight"], tensors["weight_scale"], tensors.get("weight_zero_point"), group_size,
                    bias, backend)
        return layer.prepare_cpu()

    def prepare_cpu(self):
        """Convert once for the int8 CPU kernels: the native GEMV for decode-sized calls (fp32 activations),
        torch's int8 weight-only kernel for the rest (channel-wise, K % 64 == 0 only)."""
        self.cpu_weight = cpu_quant.pack_w8a16_for_cpu(self.weight, self.weight_scale, self.weight_zero_point)
        self.native = self.bias_f32 = None
        group = resolve_group_size(self.in_features, self.weight_scale, self.group_size)
        if self.weight.device.type == "cpu" and self.weight.dtype == torch.int8 \
                and cpu_native.Int8Weight.supports(self.in_features, group) and cpu_native.gemv_available():
            self.native = cpu_native.Int8Weight(self.weight, self.weight_scale.reshape(self.out_features, -1),
                                                self.weight_zero_point, group)
            self.bias_f32 = None if self.bias is None else self.bias.float().contiguous()
        return self

    def native_desc(self):
        """(C description, most rows it serves, tensors to keep) for the fused native decode step, or None."""
        if self.native is None or self.backend is not None:
            return None
        return cpu_native.linear_desc(self.native, self.bias_f32), cpu_native.W8_MAX_ROWS, [self.native, self.bias_f32]

    def forward(self, x):
        if self.native is not None and self.backend is None and x.device.type == "cpu" and x.dim() == 2 \
                and x.shape[0] <= cpu_native.W8_MAX_ROWS:
            return cpu_native.gemv_w8(x if x.stride(1) == 1 else x.contiguous(), self.native, self.bias_f32)
        if self.dense is not None and self.backend is None and x.device.type == "cpu":
            return self.dense(x)
        if self._use_cpu_kernel(x):
            return self._finish(cpu_quant.w8a16_cpu_matmul(x, self.cpu_weight))
        y = w8a16_matmul(x, self.weight, self.weight_scale, self.weight_zero_point, self.group_size,
                         backend=self.backend)
        return self._finish(y)


class W8A8Linear(_QuantLinear):
    """int8 weights per channel x int8 activations per token (dynamic), int32 accumulation."""

    def __init__(self, weight, weight_scale, bias=None, backend=None):
        super().__init__(weight.shape[1], weight.shape[0], bias, backend)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)

    @classmethod
    def from_compressed(cls, tensors: Mapping[str, torch.Tensor], bias=None, backend=None):
        """Build from {weight (int8), weight_scale [N, 1]} (symmetric, channel-wise)."""
        check("weight_zero_point" not in tensors, "W8A8Linear: asymmetric int8 weights are not supported")
        return cls(tensors["weight"], tensors["weight_scale"], bias, backend).prepare_cpu()

    def prepare_cpu(self):
        """Prepack the weight for fbgemm (x86 CPUs)."""
        self.cpu_weight = cpu_quant.pack_w8a8_for_cpu(self.weight, self.weight_scale)
        return self

    def forward(self, x):
        if self._use_cpu_kernel(x):
            return self._finish(cpu_quant.w8a8_cpu_matmul(x, self.cpu_weight))
        return self._finish(w8a8_matmul(x, self.weight, self.weight_scale, backend=self.backend))
