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

The packed weight-only kernels are GEMV kernels: from PREFILL_MIN_ROWS_* rows (prefill) they
lose to the native prefill kernels (`cpu_prefill`: AMX, else a dequantized bf16 scratch +
oneDNN), so the weight-only paths switch there; where those cannot take the layout, from
DEQUANT_MIN_ROWS_* rows to a transient weight dequantized by torch ops + a GEMM: bf16 where oneDNN has a bf16
GEMM on this CPU (AVX-512 or AVX-NE-CONVERT), else fp32 (on AVX2 alone torch's own bf16 GEMM is the slow
reference loop: 12.7 ms against fp32's 2.5 for 128 rows of a 576 x 1536 W4 layer, 2.3 s against 17 ms for
a 1024^3 matmul, 2 vCPU AVX2, 2026-12-07). fbgemm's int8 GEMM stays fastest at every batch size.

Each `pack_*` returns None for shapes/layouts its kernel cannot take; the CPU backends
(`cpu_backends`) then route the layer elsewhere. Nothing here is imported by the Triton path.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .cpu_linear import onednn_takes
from .cpu_prefill import PrefillWeight, pack_w4a16_prefill, pack_w8a16_prefill, prefill_matmul
from .wq_matmul import dequantize, resolve_group_size, unpack_int4_stored, unpack_zero_point_stored, w4a16_dequantize

_INT4_GROUPS = (256, 128, 64, 32)  # group sizes _weight_int4pack_mm_for_cpu accepts
# Weight-only paths: from this many rows, a transient weight + GEMM (`dequant_gemm_dtype`) beats the packed
# kernel (measured on SmolLM2's shapes; unpacking int4 costs more than converting int8, and
# the 576x49152 lm_head's transient weight spills the cache, hence the margin).
DEQUANT_MIN_ROWS_W4 = 128
DEQUANT_MIN_ROWS_W8 = 64
# Where the native prefill kernels take the layer (`cpu_prefill`), they take over from fewer rows: summed
# over SmolLM2's four projections, 1 thread, AMX W4 2.1 ms vs torch's int4 kernel 3.7 at 16 rows (2.1 vs 1.8
# at 8); AMX W8 0.9 ms vs torch's int8 kernel 1.4 at 16 rows (1.0 vs 0.7 at 8). Without AMX (the dequantized
# scratch + oneDNN) the crossover is nearer 16-32 rows.
PREFILL_MIN_ROWS_W4 = 16
PREFILL_MIN_ROWS_W8 = 16


def dequant_gemm_dtype() -> torch.dtype:
    """The dtype of the transient weight and GEMM of the dequantizing routes: bf16 where oneDNN multiplies bf16
    on this CPU, else fp32 (torch's fallback bf16 GEMM is several to a hundred times slower than its fp32 one)."""
    return torch.bfloat16 if onednn_takes(torch.bfloat16) else torch.float32


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
    prefill: "PrefillWeight | None" = None  # the prefill kernels' view, where they take the layout


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
    return Int4CpuWeight(packed, sz.transpose(0, 1).contiguous().to(torch.bfloat16), g, source,
                         pack_w4a16_prefill(*source))


def w4a16_cpu_matmul(x, weight: Int4CpuWeight):
    """x [..., K] @ W.T on bf16 activations; returns x's dtype.

    Few rows (decode): the int4 kernel, which streams 4-bit weights. From PREFILL_MIN_ROWS_W4
    rows the native prefill kernel (`cpu_prefill`), where it takes the layout; without it, from
    DEQUANT_MIN_ROWS_W4 rows a transient weight dequantized by torch ops and a GEMM, in `dequant_gemm_dtype()`.
    """
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] >= PREFILL_MIN_ROWS_W4 and weight.prefill is not None:  # fp32 x keeps an fp32 output
        return prefill_matmul(x2, weight.prefill).view(*x.shape[:-1], weight.prefill.out_features)
    if x2.shape[0] >= DEQUANT_MIN_ROWS_W4:
        dtype = dequant_gemm_dtype()
        y = torch.nn.functional.linear(x2.to(dtype), w4a16_dequantize(*weight.source, dtype=dtype))
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), weight.packed, weight.group_size,
                                                       weight.scales_and_zeros)
    return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])


@dataclass(frozen=True)
class Int8CpuWeight:
    """W8 weight for `_weight_int8pack_mm`: per-channel scale, zero point folded into a correction."""

    weight: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # bf16 [N]
    zero_scale: torch.Tensor | None  # fp32 [N] = zp * scale, or None when symmetric
    prefill: "PrefillWeight | None" = None  # the prefill kernels' view, where they take the layout


def pack_w8a16_for_cpu(weight, weight_scale, weight_zero_point=None):
    """Int8CpuWeight for a channel-wise int8 layer, or None (group-wise, K % 64 != 0, not CPU)."""
    if weight_scale.reshape(weight.shape[0], -1).shape[1] != 1 or weight.shape[1] % 64 or weight.device.type != "cpu":
        return None
    scale = weight_scale.reshape(-1).float()
    zero_scale = None if weight_zero_point is None else weight_zero_point.reshape(-1).float() * scale
    weight = weight.contiguous()
    return Int8CpuWeight(weight, scale.to(torch.bfloat16), zero_scale,
                         pack_w8a16_prefill(weight, weight_scale, weight_zero_point, weight.shape[1]))


def w8a16_cpu_matmul(x, weight: Int8CpuWeight):
    """x [..., K] @ W.T on bf16 activations (int8 kernel; the prefill kernel from PREFILL_MIN_ROWS_W8
    rows, else a transient weight from DEQUANT_MIN_ROWS_W8 rows, as for W4); returns x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] >= PREFILL_MIN_ROWS_W8 and weight.prefill is not None:  # zero points folded in the weight
        return prefill_matmul(x2, weight.prefill).view(*x.shape[:-1], weight.prefill.out_features)
    if x2.shape[0] >= DEQUANT_MIN_ROWS_W8:
        dtype = dequant_gemm_dtype()
        dense = dequantize(weight.weight, weight.scale, None, -1, dtype)  # [N, K]
        y = torch.nn.functional.linear(x2.to(dtype), dense).to(x.dtype)
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
