"""Decode matmuls on weight-only quantized weights: `y = x @ dequant(W).T` for M <= 16 rows of x.

Same layout as `wq_matmul` (compressed-tensors; documented there). At decode a matmul is bound by
streaming the weight once, so the kernel is built around that stream, as Marlin is: the weight is
the dot's A operand and x.T its B operand, `out.T [N, 16] = W [N, K] @ x.T [K, 16]` (x's rows padded
to the 16 a dot needs; the tensor cores have time to spare). Each program owns BLOCK_N = 64 rows of
W and walks them along K, BLOCK_KW int32 words a row per step: the words are contiguous along K, so
Triton loads each 16-byte run once with cp.async into shared memory (software-pipelined), reads it
back in the wgmma A-operand layout and unpacks it there, in registers; on sm_90 the dot is one
HGMMA.64x16x16 per 16 columns.

Unpacking (`unpack_words`): field j of every word (nibble j for W4, byte j for W8) is a plane [rows,
words]; `_field` turns it into a float with one AND and one FMA (the field sits in the mantissa of
2^23, so no int-to-float conversion), and tl.join + tl.reshape interleave the planes back into
input-column order without moving data between threads. Zero points and scales are applied per
group mode (`group_mode`): once per row after the loop (channel-wise), once per K step, or per word.

W8A16 reads the int8 weight [N, K] as int32 [N, K/4] (4 codes a word, XOR 0x80 making them
unsigned) when its rows are whole, aligned words; otherwise (BYTES) byte by byte: correct, slower.

Filling the GPU (`plan_gemv`, a pure function of the shapes and the SM count): while the row blocks
number fewer than two per SM, K slices of the same rows are stacked into the dot's 64 rows (32 rows
x 2 slices, 16 x 4; the dot then has 16 * STACK columns and only its diagonal blocks are kept); if
SMs are still idle, K is split across programs that add fp32 partial sums atomically into a zeroed
buffer (then cast: two more small launches, which stacking avoids).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ._backend import cdiv, check, constexpr, jit, launchable, tl

GEMV_MAX_M = 16  # rows of x: the dot's N side (16, the least tl.dot takes)
BLOCK_N = 64  # rows of the dot: one warpgroup's wgmma on sm_90
GEMV_STAGES = {1: 4, 2: 3, 4: 2}  # software-pipeline depth by stacking (the x tile grows with it)

# Group modes: where scales (and zero points) are applied. Constexprs, so kernels can compare with them.
ONE = constexpr(0)  # one group per row (channel-wise): scale once after the K loop
STEP = constexpr(1)  # a group spans whole K steps: one scale per row per step, on the step's dot
WORD = constexpr(2)  # a word lies in one group: scale (and zero) gathered per word
ELEMENT = constexpr(3)  # any group size: per input column (slowest)


@jit
def _field(half, SHIFT: tl.constexpr, BITS: tl.constexpr, zero, scale, SCALED: tl.constexpr, dtype: tl.constexpr):
    """The field at bit SHIFT of `half` (2^23's exponent over 16 bits of a word) as (code - zero) * scale.

    One AND keeps the field and the exponent: the float 2^23 + u * 2^SHIFT, exact (the field stays inside
    the 23-bit mantissa). One FMA scales it back and subtracts 2^23 and the zero point: exact, as u and
    the zero point are small integers. No int-to-float conversion (I2F runs at a quarter of FMA's rate).
    """
    keep: tl.constexpr = (((1 << BITS) - 1) << SHIFT) - 8388608  # field | 0xFF800000, as an int32
    w = (half & keep).to(tl.float32, bitcast=True) * (1.0 / (1 << SHIFT)) - ((1 << (23 - SHIFT)) + zero)
    if SCALED:
        w = w * scale
    return w.to(dtype)


@jit
def unpack_words(words, zero, scale, BITS: tl.constexpr, SCALED: tl.constexpr, dtype: tl.constexpr):
    """int32 words [R, C] -> [R, C * 32 // BITS] of (code - zero) (times `scale` if SCALED) in `dtype`,
    in input-column order: field j of word c is column (32 // BITS) * c + j.

    The fields are computed as planes [R, C] (all in registers, each word loaded once) and interleaved
    with tl.join + tl.reshape, which move no data between threads. `zero`/`scale` broadcast against
    [R, C]; codes are unsigned (W4: stored q + 8; W8: int8 ^ 0x80 = q + 128).
    """
    lo = (words & 0xFFFF) | 0x4B000000  # the low 16 bits under 2^23's exponent
    hi = ((words >> 16) & 0xFFFF) | 0x4B000000
    if BITS == 4:  # fields 0-3 in lo, 4-7 in hi, at shifts 0, 4, 8, 12
        f0, f1 = _field(lo, 0, 4, zero, scale, SCALED, dtype), _field(lo, 4, 4, zero, scale, SCALED, dtype)
        f2, f3 = _field(lo, 8, 4, zero, scale, SCALED, dtype), _field(lo, 12, 4, zero, scale, SCALED, dtype)
        f4, f5 = _field(hi, 0, 4, zero, scale, SCALED, dtype), _field(hi, 4, 4, zero, scale, SCALED, dtype)
        f6, f7 = _field(hi, 8, 4, zero, scale, SCALED, dtype), _field(hi, 12, 4, zero, scale, SCALED, dtype)
        # w[..., a, b, c] = field 4a + 2b + c: the last join picks c, the first a
        w = tl.join(tl.join(tl.join(f0, f4), tl.join(f2, f6)), tl.join(tl.join(f1, f5), tl.join(f3, f7)))
    else:  # fields 0-1 in lo, 2-3 in hi, at shifts 0, 8; w[..., a, b] = field 2a + b
        f0, f1 = _field(lo, 0, 8, zero, scale, SCALED, dtype), _field(lo, 8, 8, zero, scale, SCALED, dtype)
        f2, f3 = _field(hi, 0, 8, zero, scale, SCALED, dtype), _field(hi, 8, 8, zero, scale, SCALED, dtype)
        w = tl.join(tl.join(f0, f2), tl.join(f1, f3))
    return tl.reshape(w, (words.shape[0], words.shape[1] * (32 // BITS)))


@jit
def load_zero_point(z_ptr, offs_n, grp, stride_zn, mask, BITS: tl.constexpr):
    """The zero point of rows `offs_n` in groups `grp` as fp32, in the units codes are read in
    (`unpack_words`): W4 the stored zero (zero + 8); W8 zero + 128."""
    if BITS == 4:  # packed along N: row 8r+i in bits 4i.. of word r
        zw = tl.load(z_ptr + (offs_n // 8) * stride_zn + grp, mask=mask, other=0)
        return ((zw >> ((offs_n % 8) * 4)) & 0xF).to(tl.float32)
    return tl.load(z_ptr + offs_n * stride_zn + grp, mask=mask, other=0).to(tl.float32) + 128.0


@jit
def group_params(s_ptr, z_ptr, offs_n, grp, mask, stride_sn, stride_zn, BITS: tl.constexpr, HAS_ZP: tl.constexpr):
    """(scale, zero) of rows `offs_n` in groups `grp` (broadcast together), fp32; zero as `load_zero_point`."""
    scale = tl.load(s_ptr + offs_n * stride_sn + grp, mask=mask, other=0.0).to(tl.float32)
    zero = 8.0 if BITS == 4 else 128.0  # symmetric codes
    if HAS_ZP:
        zero = load_zero_point(z_ptr, offs_n, grp, stride_zn, mask, BITS)
    return scale, zero


@jit
def weight_tile(w_ptr, s_ptr, z_ptr, offs_n, mask_n, kw, mask_kw, k, mask_k, group_size, zero, scale,
                stride_wn, stride_sn, stride_zn, BITS: tl.constexpr, HAS_ZP: tl.constexpr, GROUPS: tl.constexpr,
                GROUP_WORDS: tl.constexpr, SCALED: tl.constexpr, BYTES: tl.constexpr, dtype: tl.constexpr):
    """The dequantized weight [R, C * VALS] (input-column order) for rows `offs_n` [R, 1] and words `kw`
    [., C] (input columns `k` [., C * VALS]), each word loaded once.

    GROUPS (see `group_mode`): ONE/STEP, (code - zero) with `zero` given, times `scale` if SCALED (else
    the caller scales the dot); WORD, a scale and zero gathered per word; ELEMENT, per input column (any
    group size). BYTES: int8 [N, K] read a byte at a time (W8 rows that are not whole, aligned words).
    """
    if BYTES:
        q = tl.load(w_ptr + offs_n * stride_wn + k, mask=mask_n & mask_k, other=0)
        w = q.to(tl.float32) + 128.0  # the code as unpack_words reads it
        if GROUPS >= WORD:
            scale, zero = group_params(s_ptr, z_ptr, offs_n, k // group_size, mask_n & mask_k, stride_sn,
                                       stride_zn, BITS, HAS_ZP)
            w = (w - zero) * scale
        else:
            w = w - zero
            if SCALED:
                w = w * scale
    else:
        words = tl.load(w_ptr + offs_n * stride_wn + kw, mask=mask_n & mask_kw, other=0)
        if BITS == 8:  # int8 codes -> code + 128, unsigned (zero points carry the +128)
            words = words ^ -2139062144  # 0x80808080
        if GROUPS == ELEMENT:
            w = unpack_words(words, 0.0, 1.0, BITS, False, tl.float32)
            scale, zero = group_params(s_ptr, z_ptr, offs_n, k // group_size, mask_n & mask_k, stride_sn,
                                       stride_zn, BITS, HAS_ZP)
            w = (w - zero) * scale
        elif GROUPS == WORD:
            scale, zero = group_params(s_ptr, z_ptr, offs_n, kw // GROUP_WORDS, mask_n & mask_kw, stride_sn,
                                       stride_zn, BITS, HAS_ZP)
            w = unpack_words(words, zero, scale, BITS, True, dtype)
        else:
            w = unpack_words(words, zero, scale, BITS, SCALED, dtype)
    return w.to(dtype)


@jit
def _wq_gemv_kernel(
    x_ptr,  # [M, K] activations (fp32/fp16/bf16), M <= 16
    w_ptr,  # int32 words [N, KW] (BITS=4: 8 nibbles; BITS=8: 4 int8 codes), or int8 [N, K] when BYTES
    s_ptr,  # [N, G] scales
    z_ptr,  # BITS=4: int32 [ceil(N/8), G] packed along N; BITS=8: int8 [N, G] (if HAS_ZP)
    out_ptr,  # [M, N]: x's dtype, or fp32 accumulated atomically when SPLIT_K > 1
    M, N, K,  # problem size
    KW,  # words per row, ceil(K / VALS)
    group_size,  # K columns per scale
    kw_per_split,  # words per row per program (STACK slices)
    kw_per_slice,  # words per row per slice (a multiple of BLOCK_KW, and of GROUP_WORDS when STEP)
    stride_xm,  # row stride of x
    stride_wn,  # row stride of w, in words (in bytes when BYTES)
    stride_sn,  # row stride of the scales
    stride_zn,  # row stride of the zero points
    stride_om,  # row stride of out
    BITS: tl.constexpr,  # 4 or 8
    HAS_ZP: tl.constexpr,  # asymmetric: read zero points
    GROUPS: tl.constexpr,  # group mode: ONE, STEP, WORD or ELEMENT
    GROUP_WORDS: tl.constexpr,  # words per group (STEP, WORD)
    BYTES: tl.constexpr,  # BITS=8 only: read the int8 weight byte by byte
    IEEE: tl.constexpr,  # fp32 activations: exact fp32 dot (no tf32)
    SPLIT_K: tl.constexpr,  # programs sharing a row block along K (their sums meet in fp32 atomics)
    STACK: tl.constexpr,  # K slices of the same rows stacked in one program's dot (1, 2 or 4)
    BLOCK_N: tl.constexpr,  # rows of the dot: BLOCK_N // STACK output rows x STACK K slices
    BLOCK_KW: tl.constexpr,  # words per row per K step
):
    VALS: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = BLOCK_KW * VALS
    ROWS: tl.constexpr = BLOCK_N // STACK
    dtype: tl.constexpr = tl.float32 if IEEE else x_ptr.dtype.element_ty
    # Dot row r: output row r % ROWS over K slice r // ROWS; dot column c: x row c % 16 over slice c // 16.
    r = tl.arange(0, BLOCK_N)
    offs_n = (tl.program_id(0) * ROWS + r % ROWS)[:, None]  # [BLOCK_N, 1]
    mask_n = offs_n < N
    kw_start = tl.program_id(1) * kw_per_split
    kw_end = tl.minimum(kw_start + kw_per_split, KW)
    kw_lo = (kw_start + (r // ROWS) * kw_per_slice)[:, None]  # first word of each row's slice
    kw_hi = tl.minimum(kw_lo + kw_per_slice, kw_end)
    c = tl.arange(0, 16 * STACK)
    offs_m = c % 16
    x_lo = (kw_start + (c // 16) * kw_per_slice) * VALS  # [16 * STACK] first input column of each slice
    x_hi = tl.minimum(tl.minimum(x_lo + kw_per_slice * VALS, kw_end * VALS), K)
    row_zero = 8.0 if BITS == 4 else 128.0
    if GROUPS == ONE:
        row_scale, row_zero = group_params(s_ptr, z_ptr, offs_n, 0, mask_n, stride_sn, stride_zn, BITS, HAS_ZP)
    acc = tl.zeros((BLOCK_N, 16 * STACK), tl.float32)  # out.T, per slice
    for i in range(0, kw_per_slice, BLOCK_KW):
        kw = kw_lo + i + tl.arange(0, BLOCK_KW)[None, :]  # [BLOCK_N, BLOCK_KW]
        k = (kw_lo + i) * VALS + tl.arange(0, BLOCK_K)[None, :]  # [BLOCK_N, BLOCK_K]
        zero = row_zero
        if GROUPS == STEP:
            step_scale, zero = group_params(s_ptr, z_ptr, offs_n, (kw_lo + i) // GROUP_WORDS, mask_n, stride_sn,
                                            stride_zn, BITS, HAS_ZP)
        w = weight_tile(w_ptr, s_ptr, z_ptr, offs_n, mask_n, kw, kw < kw_hi, k, k < tl.minimum(kw_hi * VALS, K),
                        group_size, zero, 1.0, stride_wn, stride_sn, stride_zn, BITS, HAS_ZP, GROUPS, GROUP_WORDS,
                        False, BYTES, dtype)  # [BLOCK_N, BLOCK_K]; a STEP's scale goes on its dot
        kx = x_lo[None, :] + i * VALS + tl.arange(0, BLOCK_K)[:, None]  # [BLOCK_K, 16 * STACK]
        mask_x = (offs_m < M)[None, :] & (kx < x_hi[None, :])
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + kx, mask=mask_x, other=0.0).to(dtype)
        if GROUPS == STEP:
            acc += tl.dot(w, xt, input_precision="ieee" if IEEE else None) * step_scale
        else:
            acc = tl.dot(w, xt, acc, input_precision="ieee" if IEEE else None)
    if GROUPS == ONE:
        acc *= row_scale
    if STACK > 1:  # keep the blocks where a weight slice met the same x slice, and add the slices
        acc = tl.reshape(acc, (STACK, ROWS, STACK, 16))
        same = tl.arange(0, STACK)[:, None, None, None] == tl.arange(0, STACK)[None, None, :, None]
        acc = tl.sum(tl.sum(tl.where(same, acc, 0.0), axis=2), axis=0)  # [ROWS, 16]
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, 16)
    out_ptrs = out_ptr + cols[None, :] * stride_om + rows[:, None]
    mask_out = (cols < M)[None, :] & (rows < N)[:, None]
    if SPLIT_K > 1:
        tl.atomic_add(out_ptrs, acc, mask=mask_out)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)


def group_mode(groups: int, group_size: int, bits: int, block_kw: int) -> tuple[int, int]:
    """(mode, words per group) for the kernels' GROUPS/GROUP_WORDS: the cheapest exact way to apply scales."""
    vals = 32 // bits
    if groups == 1:
        return int(ONE), 0
    if group_size % vals:
        return int(ELEMENT), 0
    words = group_size // vals
    return (int(STEP) if words % block_kw == 0 else int(WORD)), words


@dataclass(frozen=True)
class GemvPlan:
    """How `wq_gemv` cuts a problem: `plan_gemv`'s answer."""

    block_kw: int  # words per row per K step
    groups: int  # group mode (ONE, STEP, WORD, ELEMENT)
    group_words: int  # words per group (STEP, WORD)
    stack: int  # K slices stacked in one program's dot
    split: int  # programs along K (fp32 atomics when > 1)
    kw_per_slice: int  # words per row per slice
    programs: int  # programs along N
    num_stages: int  # software-pipeline depth

    @property
    def kw_per_split(self) -> int:
        return self.kw_per_slice * self.stack


def gathers_columns(mode: int, bytewise: bool) -> bool:
    """Scales (and zeros) gathered per input column: ELEMENT, or groups of a weight read byte by byte. Those
    gathers are pipelined through shared memory like the weight, so such kernels take half-size steps."""
    return mode == ELEMENT or (bytewise and mode == WORD)


def plan_gemv(n: int, k: int, bits: int, group_size: int, groups: int, sm_count: int | None,
              split_k: int | None = None, max_stack: int = 4, bytewise: bool = False) -> GemvPlan:
    """Step, group mode, stacking and split for an [N, K] weight; `sm_count` None (CPU): neither.

    Steps of 128 input columns (64 when `gathers_columns`). While the row blocks number fewer than
    two per SM, stack K slices (2, then up to `max_stack`); then, while SMs are idle, split K across
    programs (doubling). Every slice keeps at least two steps. `split_k` forces the split (no
    stacking); `bytewise`: a W8 weight read byte by byte.
    """
    vals = 32 // bits
    kw = cdiv(k, vals)
    block_kw = 128 // vals
    mode, group_words = group_mode(groups, group_size, bits, block_kw)
    gathers = gathers_columns(mode, bytewise)
    block_kw //= 2 if gathers else 1
    align = group_words if mode == STEP else block_kw  # slices start on a group boundary when scaled per step
    steps = cdiv(kw, block_kw)
    stack, split = 1, split_k or 1
    if split_k is None and sm_count:
        while stack < max_stack and cdiv(n, BLOCK_N // stack) < 2 * sm_count and steps >= 4 * stack:
            stack *= 2
        while cdiv(n, BLOCK_N // stack) * split < sm_count and steps >= 4 * stack * split:
            split *= 2
    kw_per_slice = cdiv(cdiv(kw, split * stack), align) * align
    split = cdiv(kw, kw_per_slice * stack)
    stages = 2 if gathers else GEMV_STAGES[stack]
    return GemvPlan(block_kw, mode, group_words, stack, split, kw_per_slice, cdiv(n, BLOCK_N // stack), stages)


@functools.lru_cache(maxsize=None)
def device_sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device `index`, asked once (every quantized matmul launch reads it).
    Whoever makes torch answer for another card (the compile check's simulated GPUs) clears this cache."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device (what the split rules fill); None elsewhere."""
    if device.type != "cuda":
        return None
    return device_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def as_words(weight: torch.Tensor) -> torch.Tensor | None:
    """int8 [N, K] viewed as int32 [N, K/4] (4 codes a word), or None when its rows are not whole, aligned words."""
    if weight.shape[1] % 4 or weight.stride(1) != 1 or weight.stride(0) % 4 or weight.storage_offset() % 4:
        return None
    return weight.view(torch.int32)


def wq_gemv(x2, weight, scale, zero_point, n, group_size, bits, split_k=None, sms=None):
    """`x2 @ dequant(W).T` for x2 [M <= 16, K] (last dim contiguous) -> [M, N] in x2's dtype.

    Layouts as `w4a16_matmul` / `w8a16_matmul` take them (and check them); `group_size` resolved.
    `sms`: the SM count `plan_gemv` fills (None: the device's; on CPU no stacking or split);
    `split_k` forces a split.
    """
    m, k = x2.shape
    check(1 <= m <= GEMV_MAX_M, f"wq_gemv takes 1..{GEMV_MAX_M} rows of x, got {m}")
    words = weight if bits == 4 else as_words(weight)
    w = words if words is not None else weight
    plan = plan_gemv(n, k, bits, group_size, scale.shape[1], sms if sms is not None else sm_count(x2.device),
                     split_k, max_stack=2 if x2.dtype == torch.float32 else 4,  # fp32's FMA dot spills at 4
                     bytewise=words is None)
    out = (torch.zeros(m, n, dtype=torch.float32, device=x2.device) if plan.split > 1
           else torch.empty(m, n, dtype=x2.dtype, device=x2.device))
    zp = zero_point if zero_point is not None else scale
    launchable(_wq_gemv_kernel, x2.device)[(plan.programs, plan.split)](
        x2, w, scale, zp, out, m, n, k, cdiv(k, 32 // bits), group_size, plan.kw_per_split, plan.kw_per_slice,
        x2.stride(0), w.stride(0), scale.stride(0), zp.stride(0), out.stride(0),
        BITS=bits, HAS_ZP=zero_point is not None, GROUPS=plan.groups, GROUP_WORDS=plan.group_words,
        BYTES=words is None, IEEE=x2.dtype == torch.float32, SPLIT_K=plan.split, STACK=plan.stack,
        BLOCK_N=BLOCK_N, BLOCK_KW=plan.block_kw, num_warps=4, num_stages=plan.num_stages,
    )
    return out.to(x2.dtype)
