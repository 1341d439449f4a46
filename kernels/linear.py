"""Linear layers whose kernels a backend chooses once, at load time: the routing base and the quantized layers.

A `RoutedLinear` computes `x [..., K] -> [..., N]` with at most two kernels and one row-count policy:
calls of up to `small_rows` rows take `small`, larger ones `large`. Which kernels those are is decided
by the backend that built the layer (`kernels.backend`), never per call from the device or a string.

The quantized layers are built from compressed-tensors tensors with `from_compressed(tensors, ...)`
(names without the module prefix, e.g. {"weight_packed", "weight_scale", "weight_shape"}) and keep that
layout as buffers. Built alone, a layer runs its op's exact torch twin (dequantized fp32 matmul); a
backend then routes it to its own kernels with `route(...)` and may attach the CPU layouts it made:
`cpu_weight` (torch's packed CPU kernel), `native` (the native GEMV, which the fused decode step reads)
and `dense` (a dequantized dense copy for the rows no quantized kernel takes).
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn

from ._backend import check
from .w8a8 import w8a8_matmul
from .wq_matmul import resolve_group_size, w4a16_matmul, w8a16_matmul

Kernel = Callable[[torch.Tensor], torch.Tensor]  # x [M, K] -> y [M, N] in x's dtype, bias included


class RoutedLinear(nn.Module):
    """`x @ W.T + bias` through the kernels its backend chose: `small` up to `small_rows` rows, else `large`."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.small: Kernel | None = None
        self.small_rows = -1  # no call takes `small` until a backend routes one
        self.large: Kernel | None = None

    def route(self, large: Kernel, small: Kernel | None = None, small_rows: int = -1) -> "RoutedLinear":
        """Fix the kernels: calls of up to `small_rows` rows run `small`, the others `large`."""
        self.large, self.small, self.small_rows = large, small, small_rows if small is not None else -1
        return self

    def forward(self, x):
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        y = self.small(x2) if x2.shape[0] <= self.small_rows else self.large(x2)  # [M, N]
        return y.view(*x.shape[:-1], self.out_features)


class QuantLinear(RoutedLinear):
    """Shared plumbing of the quantized layers: bias, the op on a given op backend, the CPU layouts."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__(in_features, out_features)
        self.register_buffer("bias", bias)
        self.cpu_weight = None  # torch's CPU kernel layout (`cpu_quant`), where the backend made one
        self.native = None  # `cpu_linear.NativeLinear`, where the backend runs few rows on the native GEMV
        self.dense = None  # a dequantized `cpu_linear.DenseLinear`, where the backend keeps one
        self.route(self.op_kernel("torch"))

    def op_kernel(self, op_backend: str) -> Kernel:
        """The layer's kernel op on `op_backend` ("torch": the exact twin, "triton"), bias added after."""
        def run(x):
            return self.add_bias(self.matmul(x, op_backend))
        return run

    def matmul(self, x: torch.Tensor, op_backend: str) -> torch.Tensor:
        """x [M, K] @ W.T without bias, by the op of `llmopt.kernels` on `op_backend`."""
        raise NotImplementedError

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        """y plus the bias (in y's dtype), if there is one."""
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        parts = [f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"]
        parts += [f"{name}={type(value).__name__}" for name, value in
                  (("cpu", self.cpu_weight), ("native", self.native)) if value is not None]
        return ", ".join(parts)


class W4A16Linear(QuantLinear):
    """int4 weight-only linear (pack-quantized, group-wise or channel-wise, sym or asym)."""

    def __init__(self, weight_packed, weight_scale, in_features, weight_zero_point=None, group_size=None, bias=None):
        super().__init__(in_features, weight_packed.shape[0], bias)
        self.register_buffer("weight_packed", weight_packed)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight_zero_point", weight_zero_point)
        self.group_size = resolve_group_size(in_features, weight_scale, group_size)

    @classmethod
    def from_compressed(cls, tensors: Mapping[str, torch.Tensor], group_size=None, bias=None) -> "W4A16Linear":
        """Build from {weight_packed, weight_scale, weight_shape[, weight_zero_point]}; group_size -1: channel-wise,
        None: inferred from the scales."""
        out_features, in_features = (int(v) for v in tensors["weight_shape"].tolist())
        check(tensors["weight_packed"].shape[0] == out_features,
              "W4A16Linear: weight_shape disagrees with weight_packed")
        return cls(tensors["weight_packed"], tensors["weight_scale"], in_features, tensors.get("weight_zero_point"),
                   group_size, bias)

    def matmul(self, x, op_backend):
        return w4a16_matmul(x, self.weight_packed, self.weight_scale, self.weight_zero_point, self.group_size,
                            backend=op_backend)


class W8A16Linear(QuantLinear):
    """int8 weight-only linear: int8 `weight` [N, K], `weight_scale` [N, G], optional zero point."""

    def __init__(self, weight, weight_scale, weight_zero_point=None, group_size=None, bias=None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight_zero_point", weight_zero_point)
        self.group_size = resolve_group_size(self.in_features, weight_scale, group_size)

    @classmethod
    def from_compressed(cls, tensors: Mapping[str, torch.Tensor], group_size=None, bias=None) -> "W8A16Linear":
        """Build from {weight (int8), weight_scale[, weight_zero_point]}."""
        return cls(tensors["weight"], tensors["weight_scale"], tensors.get("weight_zero_point"), group_size, bias)

    def matmul(self, x, op_backend):
        return w8a16_matmul(x, self.weight, self.weight_scale, self.weight_zero_point, self.group_size,
                            backend=op_backend)


class W8A8Linear(QuantLinear):
    """int8 weights per channel x int8 activations per token (dynamic), int32 accumulation."""

    def __init__(self, weight, weight_scale, bias=None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)

    @classmethod
    def from_compressed(cls, tensors: Mapping[str, torch.Tensor], group_size=None, bias=None) -> "W8A8Linear":
        """Build from {weight (int8), weight_scale [N, 1]} (symmetric, channel-wise; `group_size` is ignored)."""
        check("weight_zero_point" not in tensors, "W8A8Linear: asymmetric int8 weights are not supported")
        return cls(tensors["weight"], tensors["weight_scale"], bias)

    def matmul(self, x, op_backend):
        return w8a8_matmul(x, self.weight, self.weight_scale, backend=op_backend)


QUANTIZED = {"w4a16": W4A16Linear, "w8a16": W8A16Linear, "w8a8": W8A8Linear}  # formats a backend builds
