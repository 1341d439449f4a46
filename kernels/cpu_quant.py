"""CPU fast paths for the quantized linears: convert the compressed-tensors layout once at load
time into the layout of a packed torch CPU kernel, then call that kernel per forward.

Measured here (2 vCPU AVX-512, see `llmopt profile --kernels`): at batch 1 the decode step is
memory-bound, so the winner is whichever kernel streams the fewest weight bytes without
becoming compute-bound on unpacking:

- W4A16 -> `aten._weight_int4pack_mm_for_cpu` on bf16 activations (its fp32 path is ~30x
  slower). Weight-only: activations and scales rounded to bf16, fp32 accumulation.
- W8A16 -> `aten._weight_int8pack_mm` on bf16 activations (same reason). Weight-only.
  Its bf16 kernel is wrong when K is not a multiple of 64 (NaN/inf, even a crash at K=40), so
  such shapes fall back to the torch reference.
- W8A8 -> fbgemm's `quantized::linear_dynamic` (what torch.ao dynamic int8 uses). fbgemm picks
  one activation scale per call; we first divide each row by its max |x| and multiply the
  output back, which gives every token its own scale (per-token, as the Triton kernel): a
  token keeps int8 precision whatever else is in the batch. Activations are asymmetric uint8
  over the batch's [min, max] of the normalised rows, so numerics differ slightly from the
  symmetric per-token twin (same error level, checked in tests/kernels/test_linear.py).

The packed weight-only kernels are GEMV kernels: from DEQUANT_MIN_ROWS_* rows (prefill) they
lose to a transient bf16 weight + bf16 GEMM, so the weight-only paths switch there (the
transient weight lives for one call). fbgemm's int8 GEMM stays fastest at every batch size.

Each `pack_*` returns None for shapes/layouts its kernel cannot take; the CPU backends
(`cpu_backends`) then route the layer elsewhere. Nothing here is imported by the Triton path.
"""
from __future__ import annotations

import ctypes
import functools
import threading
import warnings
from dataclasses import dataclass

import torch

from . import cpu_native
from .cpu_linear import on_row_buckets
from .wq_matmul import dequantize, resolve_group_size, unpack_int4_stored, unpack_zero_point_stored, w4a16_dequantize

_INT4_GROUPS = (256, 128, 64, 32)  # group sizes _weight_int4pack_mm_for_cpu accepts
# Weight-only paths: from this many rows, a transient bf16 weight + bf16 GEMM beats the packed
# kernel (measured on SmolLM2's shapes; unpacking int4 costs more than converting int8, and
# the 576x49152 lm_head's transient weight spills the cache, hence the margin).
DEQUANT_MIN_ROWS_W4 = 128
DEQUANT_MIN_ROWS_W8 = 64


@dataclass(frozen=True)
class Int4CpuWeight:
    """W4 weight in `_weight_int4pack_mm_for_cpu` layout: (q - 8) * scale + zero per group.

    Also holds the compressed-tensors tensors it came from (the same tensors, not copies), to
    dequantize a transient bf16 weight for large batches.
    """

    packed: torch.Tensor  # uint8 [N, K/2] from _convert_weight_to_int4pack_for_cpu
    scales_and_zeros: torch.Tensor  # bf16 [K/group, N, 2]
    group_size: int
    source: tuple  # (weight_packed, weight_scale, in_features, weight_zero_point, group_size)


def _cpu_group(in_features: int, group_size: int) -> int | None:
    """Largest kernel group that tiles both K and our group (scales are then repeated)."""
    for g in _INT4_GROUPS:
        if group_size % g == 0 and in_features % g == 0:
            return g
    return None


def pack_w4a16_for_cpu(weight_packed, weight_scale, in_features, weight_zero_point=None, group_size=None):
    """Int4CpuWeight for a pack-quantized layer, or None when the CPU kernel cannot take it."""
    n = weight_packed.shape[0]
    group_size = resolve_group_size(in_features, weight_scale, group_size)
    g = _cpu_group(in_features, group_size)
    if g is None or n % 16 != 0 or weight_packed.device.type != "cpu":
        return None
    q = unpack_int4_stored(weight_packed, in_features).to(torch.int32)  # [N, K] stored values 0..15
    scale = weight_scale.float()
    if weight_zero_point is None:
        zero = torch.zeros_like(scale)
    else:  # (q - zp) * s == (q - 8) * s + (8 - zp) * s
        zero = (8.0 - unpack_zero_point_stored(weight_zero_point, n).float()) * scale
    reps, groups = group_size // g, in_features // g
    sz = torch.stack([scale, zero], dim=-1).repeat_interleave(reps, dim=1)[:, :groups]  # [N, K/g, 2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    source = (weight_packed, weight_scale, in_features, weight_zero_point, group_size)
    return Int4CpuWeight(packed, sz.transpose(0, 1).contiguous().to(torch.bfloat16), g, source)


def w4a16_cpu_matmul(x, weight: Int4CpuWeight):
    """x [..., K] @ W.T on bf16 activations; returns x's dtype.

    Few rows (decode): the int4 kernel, which streams 4-bit weights. From DEQUANT_MIN_ROWS_W4
    rows (prefill) that kernel is slower than dequantizing a transient bf16 weight and
    running a bf16 GEMM, whose cost the rows amortise.
    """
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    if x2.shape[0] >= DEQUANT_MIN_ROWS_W4:
        y = torch.nn.functional.linear(x2, w4a16_dequantize(*weight.source, dtype=torch.bfloat16))
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, weight.packed, weight.group_size, weight.scales_and_zeros)
    return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])


@dataclass(frozen=True)
class Int8CpuWeight:
    """W8 weight for `_weight_int8pack_mm`: per-channel scale, zero point folded into a correction."""

    weight: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # bf16 [N]
    zero_scale: torch.Tensor | None  # fp32 [N] = zp * scale, or None when symmetric


def pack_w8a16_for_cpu(weight, weight_scale, weight_zero_point=None):
    """Int8CpuWeight for a channel-wise int8 layer, or None (group-wise, K % 64 != 0, not CPU)."""
    if weight_scale.reshape(weight.shape[0], -1).shape[1] != 1 or weight.shape[1] % 64 or weight.device.type != "cpu":
        return None
    scale = weight_scale.reshape(-1).float()
    zero_scale = None if weight_zero_point is None else weight_zero_point.reshape(-1).float() * scale
    return Int8CpuWeight(weight.contiguous(), scale.to(torch.bfloat16), zero_scale)


def w8a16_cpu_matmul(x, weight: Int8CpuWeight):
    """x [..., K] @ W.T on bf16 activations (int8 kernel; transient bf16 weight from
    DEQUANT_MIN_ROWS_W8 rows, as for W4); returns x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] >= DEQUANT_MIN_ROWS_W8:
        dense = dequantize(weight.weight, weight.scale, None, -1, torch.bfloat16)  # [N, K]
        y = torch.nn.functional.linear(x2.to(torch.bfloat16), dense).to(x.dtype)
    else:
        y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), weight.weight, weight.scale).to(x.dtype)
    if weight.zero_scale is not None:  # x @ ((q - z) s).T = x @ (q s).T - sum(x) * z s
        y = y - x2.sum(-1, keepdim=True).to(x.dtype) * weight.zero_scale.to(x.dtype)
    return y.view(*x.shape[:-1], y.shape[-1])


def fbgemm_available() -> bool:
    """fbgemm's int8 GEMM exists on x86 builds of torch (engine 'x86' or 'fbgemm')."""
    ops = torch.ops.quantized
    return torch.backends.quantized.engine in ("x86", "fbgemm") and hasattr(ops, "linear_prepack") \
        and hasattr(ops, "linear_dynamic")


@dataclass(frozen=True)
class Int8DynamicCpuWeight:
    """W8A8 weight prepacked for fbgemm's dynamic-activation linear."""

    packed: object  # torch.classes.quantized.LinearPackedParamsBase
    out_features: int


def pack_w8a8_for_cpu(weight, weight_scale):
    """Prepack a per-channel int8 weight for fbgemm, or None where fbgemm is missing."""
    if not fbgemm_available() or weight.device.type != "cpu":
        return None
    n = weight.shape[0]
    zeros = torch.zeros(n, dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated; fbgemm still needs one to prepack
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch._make_per_channel_quantized_tensor(weight.contiguous(), weight_scale.reshape(-1).double(),
                                                           zeros, 0)
    return Int8DynamicCpuWeight(torch.ops.quantized.linear_prepack(qweight, None), n)


def w8a8_cpu_matmul(x, weight: Int8DynamicCpuWeight):
    """x [..., K] @ W.T with per-token int8 activations through fbgemm; returns x's dtype."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    # Also for one token: fbgemm loses precision on rows of small magnitude (2% vs 0.9% error
    # at max|x| = 1e-3, measured), so every row is brought to max|x| = 1 first.
    row_max = x2.abs().amax(-1, keepdim=True).clamp_min(1e-12)
    y = torch.ops.quantized.linear_dynamic(x2 / row_max, weight.packed, False) * row_max
    return y.to(x.dtype).view(*x.shape[:-1], weight.out_features)


# --- prefill: dequantize into a bf16 scratch (csrc/dequant.c), then oneDNN's bf16 GEMM ---------------------
# Weight elements dequantized per chunk: the scratch (bf16) is at most this big, and the GEMM reads it
# while it is still in cache. Larger layers (a quantized lm_head, big models) go chunk by chunk of rows.
PREFILL_CHUNK_ELEMS = 1 << 21
_scratch = threading.local()


@dataclass(frozen=True)
class PrefillWeight:
    """A weight-only layer's tensors as csrc/dequant.c reads them: the codes are the layer's own tensor (no
    copy); scales fp32 [N, G] and zero points [N, G] (None: symmetric) are converted once (small)."""

    bits: int  # 4: int32 [N, K/8] pack-quantized codes; 8: int8 [N, K]
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group: int
    out_features: int
    in_features: int

    def dequantize_rows(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """Rows start..stop of the bf16 weight, written into `out` [stop - start, K]."""
        zeros = None if self.zeros is None else self.zeros[start:stop]
        fn = _dequant_fn(self.bits)
        rc = fn(self.q[start:].data_ptr(), self.q.stride(0), self.scales[start:].data_ptr(),
                None if zeros is None else zeros.data_ptr(), self.group, out.data_ptr(), stop - start,
                self.in_features)
        if rc:
            raise ValueError(f"dequantize W{self.bits}: K={self.in_features}, group {self.group} not supported")
        return out


@functools.lru_cache(maxsize=None)
def _dequant_fn(bits: int):
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_native.native_function(f"llmopt_dequant_w{bits}_bf16", [ptr, i64, ptr, ptr, i64, ptr, i64, i64])


@functools.lru_cache(maxsize=1)
def prefill_available() -> bool:
    """The native dequantizers are built with their AVX-512 BF16 path and torch has oneDNN (else their
    portable loop + a plain GEMM would not beat today's routes)."""
    fast = cpu_native.native_function("llmopt_dequant_fast", [])
    return fast is not None and bool(fast()) and torch.backends.mkldnn.is_available()


def pack_w4a16_prefill(weight_packed, weight_scale, in_features, weight_zero_point=None, group_size=None):
    """PrefillWeight for a pack-quantized int4 layer, or None where the dequantizer cannot take it (K or the
    group not a multiple of 32, not on CPU, the native library missing)."""
    n = weight_packed.shape[0]
    group = resolve_group_size(in_features, weight_scale, group_size)
    if in_features % 32 or group % 32 or in_features % group or weight_packed.dtype != torch.int32 \
            or weight_packed.stride(-1) != 1 or weight_packed.device.type != "cpu" or not prefill_available():
        return None
    zeros = None if weight_zero_point is None else unpack_zero_point_stored(weight_zero_point, n).contiguous()
    scales = weight_scale.reshape(n, -1).float().contiguous()
    return PrefillWeight(4, weight_packed, scales, zeros, group, n, in_features)


def pack_w8a16_prefill(weight, weight_scale, weight_zero_point=None, group_size=None):
    """PrefillWeight for an int8 layer (per channel or in groups), or None (K or the group not a multiple of 16,
    not on CPU, the native library missing)."""
    n, k = weight.shape
    group = resolve_group_size(k, weight_scale, group_size)
    if k % 16 or group % 16 or k % group or weight.dtype != torch.int8 or weight.stride(-1) != 1 \
            or weight.device.type != "cpu" or not prefill_available():
        return None
    zeros = None if weight_zero_point is None else weight_zero_point.reshape(n, -1).to(torch.int8).contiguous()
    return PrefillWeight(8, weight, weight_scale.reshape(n, -1).float().contiguous(), zeros, group, n, k)


def _scratch_rows(rows: int, k: int) -> torch.Tensor:
    """This thread's reusable bf16 scratch, viewed as [rows, K] (grown when a layer needs more)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < rows * k:
        buf = _scratch.buf = torch.empty(rows * k, dtype=torch.bfloat16)
    return buf[:rows * k].view(rows, k)


def prefill_matmul(x: torch.Tensor, weight: PrefillWeight) -> torch.Tensor:
    """x [M, K] @ W.T for prefill-sized M: W dequantized chunk by chunk of output rows into a scratch (bf16,
    each element bf16((q - zero) * scale)), then oneDNN's bf16 GEMM (AMX where present) on row buckets,
    fp32 accumulation. Returns x's dtype. Nothing outlives the call but the scratch, reused by the next."""
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
