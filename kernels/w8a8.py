"""W8A8: int8 weights per output channel x int8 activations quantized per token at run time.

Layout (compressed-tensors "int-quantized"): `weight` int8 [N, K], `weight_scale` [N, 1].
Activations: scale_m = max|x_m| / 127, q = round(x / scale_m) with halves rounded away from
zero (both paths), accumulate q_x . q_w exactly in int32, then y = acc * scale_m * scale_n.
"""
from __future__ import annotations

import torch

from ._backend import cdiv, check, jit, launchable, next_pow2, pick_backend, tl

_TINY = 1e-12  # floor for an all-zero row's scale


@jit
def _quant_per_token_kernel(
    x_ptr,  # [M, K] activations
    q_ptr,  # [M, K] int8 output
    s_ptr,  # [M] fp32 output scales
    stride_xm,  # row stride of x
    stride_qm,  # row stride of q
    K,  # columns
    BLOCK: tl.constexpr,  # power of two >= K: one program per row
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 127.0
    y = x / scale
    q = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(-y + 0.5))
    tl.store(q_ptr + row * stride_qm + cols, q.to(tl.int8), mask=mask)
    tl.store(s_ptr + row, scale)


@jit
def _int8_matmul_kernel(
    a_ptr,  # [M, K] int8 activations
    b_ptr,  # [N, K] int8 weights
    sa_ptr,  # [M] fp32 activation scales
    sb_ptr,  # [N] weight scales
    out_ptr,  # [M, N] output
    M, N, K,  # problem size
    stride_am,  # row stride of a
    stride_bn,  # row stride of b
    stride_om,  # row stride of out
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # tile sizes
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0, tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0)
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0)
        acc += tl.dot(a, b, out_dtype=tl.int32)
    sa = tl.load(sa_ptr + offs_m, mask=mask_m, other=0.0)
    sb = tl.load(sb_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    out = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def quantize_per_token_ref(x):
    """Torch twin: (int8 q [M, K], fp32 scale [M]) with halves rounded away from zero."""
    x = x.float()
    scale = x.abs().amax(-1).clamp_min(_TINY) / 127.0
    y = x / scale[:, None]
    q = torch.sign(y) * torch.floor(y.abs() + 0.5)
    return q.to(torch.int8), scale


def w8a8_matmul_ref(x, weight, weight_scale):
    """Torch twin: per-token int8 activations, exact integer dot (in fp64), rescale."""
    x2 = x.reshape(-1, x.shape[-1])
    q, sx = quantize_per_token_ref(x2)
    acc = q.double() @ weight.double().t()  # exact: |sum| < 2^53
    out = acc * sx.double()[:, None] * weight_scale.double().reshape(1, -1)
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def quantize_per_token(x, backend=None):
    """Dynamic symmetric int8 quantization of each row of x [M, K] -> (q int8, scale fp32 [M])."""
    check(x.dim() == 2, "quantize_per_token: x must be [M, K]")
    if pick_backend(x, backend) == "torch":
        return quantize_per_token_ref(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        launchable(_quant_per_token_kernel, x.device)[(x.shape[0],)](
            x, q, scale, x.stride(0), q.stride(0), x.shape[1], BLOCK=next_pow2(x.shape[1]))
    return q, scale


def w8a8_matmul(x, weight, weight_scale, backend=None):
    """`x @ W.T` with per-token dynamic int8 activations; x [..., K] -> [..., N] in x's dtype."""
    n, k = weight.shape
    check(weight.dtype == torch.int8 and k == x.shape[-1],
          f"w8a8: weight must be int8 [N, {x.shape[-1]}], got {weight.dtype} {tuple(weight.shape)}")
    check(weight_scale.numel() == n, "w8a8: weight_scale must be per output channel ([N] or [N, 1])")
    if pick_backend(x, backend) == "torch":
        return w8a8_matmul_ref(x, weight, weight_scale)
    x2 = x.reshape(-1, k)
    q, sx = quantize_per_token(x2, backend="triton")
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = min(64, max(16, next_pow2(m)))
    if m:
        launchable(_int8_matmul_kernel, x.device)[(cdiv(m, block_m), cdiv(n, 64))](
            q, weight, sx, weight_scale.reshape(-1), out, m, n, k, q.stride(0), weight.stride(0), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64)
    return out.view(*x.shape[:-1], n)
