"""Prefill-sized matmuls on weight-only quantized layers (W4A16, W8A16) on CPU, with no dense copy of the
weight kept and no unpacking through torch ops.

Measured here (Xeon with AMX, 1 thread, SmolLM2's 576 -> 3072 gate_up at 512 rows; docs/kernels.md has
the table): oneDNN's bf16 GEMM on a reordered dense weight 1.4-1.6 ms; the route before this one
(`wq_matmul.w4a16_dequantize` with torch ops, then F.linear) 4-7 ms; torch's int4 kernel 23 ms.

- On a CPU with AMX: `csrc/amx_wq.c` dequantizes 32 output columns at a time straight into AMX tiles'
  layout (in cache) and multiplies every row of x against them (TDPBF16PS): ~1.6 ms (W4), no scratch.
- Otherwise (no AMX, N or the group not a multiple of 32): `csrc/dequant.c` writes the bf16 weight into a reusable
  scratch (~0.25 ms for that layer), then oneDNN's bf16 GEMM runs on it (AMX where present): ~2-2.6 ms.
  The scratch is per thread and at most PREFILL_CHUNK_ELEMS elements; larger weights go by chunks of rows.

Numerics (both): each weight element is bf16((q - zero) * scale) computed in fp32, the bf16 nearest the
exact twin's weight (`wq_matmul.dequantize`); activations bf16, fp32 accumulation, one rounding to x's dtype.
"""
from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass

import torch

from . import cpu_native
from .cpu_linear import on_row_buckets
from .wq_matmul import resolve_group_size, unpack_zero_point_stored

# Weight elements dequantized per chunk on the scratch route: the scratch (bf16) is at most this big.
# Larger layers (a quantized lm_head, big models) go chunk by chunk of output rows.
PREFILL_CHUNK_ELEMS = 1 << 21
_scratch = threading.local()
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@dataclass(frozen=True)
class PrefillWeight:
    """A weight-only layer's tensors as the native prefill kernels read them: the codes are the layer's own
    tensor (no copy); scales and zero points converted once to fp32 / integers (small: [N, K / group])."""

    bits: int  # 4: int32 [N, >= K/8] pack-quantized codes; 8: int8 [N, K]
    q: torch.Tensor
    scales: torch.Tensor  # fp32 [N, G]
    zeros: torch.Tensor | None  # stored zero points [N, G] (W4: uint8 0..15, W8: int8); None: symmetric
    group: int
    out_features: int
    in_features: int
    amx: tuple | None = None  # on AMX: (scales, zeros as fp32 or None), both transposed to [G, N]

    def dequantize_rows(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """Rows start..stop of the bf16 weight, written into `out` [stop - start, K] (contiguous)."""
        with _traced(f"dequantize_w{self.bits}"):
            return self._dequantize(start, stop, out)

    def _dequantize(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.shape != (stop - start, self.in_features) \
                or not 0 <= start <= stop <= self.out_features:
            raise ValueError(f"dequantize W{self.bits}: out must be a contiguous bf16 [{stop - start}, "
                             f"{self.in_features}] for rows {start}..{stop} of {self.out_features}")
        zeros = None if self.zeros is None else self.zeros[start:stop]
        rc = _native(f"llmopt_dequant_w{self.bits}_bf16", (_PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64))(
            self.q[start:].data_ptr(), self.q.stride(0), self.scales[start:].data_ptr(),
            None if zeros is None else zeros.data_ptr(), self.group, out.data_ptr(), stop - start, self.in_features)
        if rc:
            raise ValueError(f"dequantize W{self.bits}: K={self.in_features}, group {self.group} not supported")
        return out


class _traced:
    """`llmopt::<name>` under torch.profiler, which cannot see into ctypes calls; free when none runs."""

    def __init__(self, name: str):
        self.record = torch.profiler.record_function(f"llmopt::{name}") \
            if torch.autograd.profiler._is_profiler_enabled else None

    def __enter__(self):
        return None if self.record is None else self.record.__enter__()

    def __exit__(self, *exc):
        return None if self.record is None else self.record.__exit__(*exc)


@functools.lru_cache(maxsize=None)
def _native(name: str, argtypes: tuple):
    return cpu_native.native_function(name, list(argtypes))


@functools.lru_cache(maxsize=1)
def prefill_available() -> bool:
    """The native dequantizers are built with their AVX-512 BF16 path and torch has oneDNN (elsewhere their
    portable loop and a plain GEMM would not beat the routes without them)."""
    fast = _native("llmopt_dequant_fast", ())
    return fast is not None and bool(fast()) and torch.backends.mkldnn.is_available()


@functools.lru_cache(maxsize=1)
def amx_available() -> bool:
    """The W4 AMX kernel was built (gcc knew AMX) and the OS granted this process AMX's tile state."""
    fn = _native("llmopt_amx_available", ())
    return fn is not None and bool(fn())


def pack_w4a16_prefill(weight_packed, weight_scale, in_features, weight_zero_point=None, group_size=None):
    """PrefillWeight for a pack-quantized int4 layer, or None where no prefill kernel takes it (K or the group
    not a multiple of 32, not on CPU, the native library or its AVX-512 BF16 path missing)."""
    n = weight_packed.shape[0]
    group = resolve_group_size(in_features, weight_scale, group_size)
    if in_features % 32 or group % 32 or in_features % group or weight_packed.dtype != torch.int32 \
            or weight_packed.stride(-1) != 1 or weight_packed.device.type != "cpu" or not prefill_available():
        return None
    zeros = None if weight_zero_point is None else unpack_zero_point_stored(weight_zero_point, n).contiguous()
    scales = weight_scale.reshape(n, -1).float().contiguous()
    return PrefillWeight(4, weight_packed, scales, zeros, group, n, in_features, _amx_layout(n, group, scales, zeros))


def pack_w8a16_prefill(weight, weight_scale, weight_zero_point=None, group_size=None):
    """PrefillWeight for an int8 layer (per channel or in groups), or None (K or the group not a multiple of 16,
    not on CPU, the native library or its AVX-512 BF16 path missing)."""
    n, k = weight.shape
    group = resolve_group_size(k, weight_scale, group_size)
    if k % 16 or group % 16 or k % group or weight.dtype != torch.int8 or weight.stride(-1) != 1 \
            or weight.device.type != "cpu" or not prefill_available():
        return None
    zeros = None if weight_zero_point is None else weight_zero_point.reshape(n, -1).to(torch.int8).contiguous()
    scales = weight_scale.reshape(n, -1).float().contiguous()
    return PrefillWeight(8, weight, scales, zeros, group, n, k, _amx_layout(n, group, scales, zeros))


def _amx_layout(n: int, group: int, scales: torch.Tensor, zeros: torch.Tensor | None) -> tuple | None:
    """(scales, zeros) as the AMX kernel reads them, fp32 [G, N], where it takes the layer (N and the group
    multiples of 32, so K too), else None."""
    if n % 32 or group % 32 or not amx_available():
        return None
    return scales.t().contiguous(), None if zeros is None else zeros.float().t().contiguous()


def prefill_matmul(x: torch.Tensor, weight: PrefillWeight) -> torch.Tensor:
    """x [M, K] @ W.T for prefill-sized M on bf16 activations, fp32 accumulation; returns x's dtype.
    W4 with AMX: the AMX kernel. Else W dequantized into this thread's scratch, then oneDNN's bf16 GEMM."""
    if weight.amx is not None:
        return _amx_matmul(x, weight)
    n, k = weight.out_features, weight.in_features
    x2 = x.to(torch.bfloat16)
    step = max(16, PREFILL_CHUNK_ELEMS // k // 16 * 16)
    chunks = []
    for start in range(0, n, step):
        stop = min(n, start + step)
        w = weight.dequantize_rows(start, stop, _scratch_rows(stop - start, k))  # [rows, K] bf16
        chunks.append(on_row_buckets(lambda xb: torch.ops.mkldnn._linear_pointwise(xb, w, None, "none", [None], ""),
                                     x2))
    y = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)  # [M, N]
    return y.to(x.dtype)


def _scratch_rows(rows: int, k: int) -> torch.Tensor:
    """This thread's reusable bf16 scratch, viewed as [rows, K] (grown when a layer needs more)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < rows * k:
        buf = _scratch.buf = torch.empty(rows * k, dtype=torch.bfloat16)
    return buf[:rows * k].view(rows, k)


def _amx_matmul(x: torch.Tensor, weight: PrefillWeight) -> torch.Tensor:
    m, k = x.shape
    mp = -(-m // 32) * 32
    xb = x.to(torch.bfloat16).contiguous()
    if mp != m:  # the kernel reads whole blocks of 32 rows
        xb = torch.cat([xb, xb.new_zeros(mp - m, k)])  # [mp, K]
    out_dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    y = torch.empty(m, weight.out_features, dtype=out_dtype)
    scales_t, zeros_t = weight.amx
    with _traced(f"amx_w{weight.bits}_matmul"):
        rc = _native("llmopt_amx_wq_matmul", (_PTR, _PTR, _I64, ctypes.c_int, _PTR, _PTR, _I64, _PTR, _I64,
                                              ctypes.c_int, _I64, _I64, _I64))(
            xb.data_ptr(), weight.q.data_ptr(), weight.q.stride(0) * weight.q.element_size(), weight.bits,
            scales_t.data_ptr(), None if zeros_t is None else zeros_t.data_ptr(), weight.group, y.data_ptr(),
            y.stride(0), 0 if out_dtype == torch.float32 else 1, m, weight.out_features, k)
    if rc:
        raise (MemoryError if rc == 2 else ValueError)(f"amx_w{weight.bits}_matmul: failed for x {tuple(x.shape)}, "
                                                       f"weight [{weight.out_features}, {k}] group {weight.group}")
    return y.to(x.dtype)
