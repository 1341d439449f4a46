"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm block."""
from __future__ import annotations

import torch

from ._backend import check, jit, launchable, next_pow2, pick_backend, tl


@jit
def _rms_norm_kernel(
    x_ptr,  # [rows, hidden] input
    res_ptr,  # [rows, hidden] residual, read then overwritten with x + residual (if HAS_RESIDUAL)
    w_ptr,  # [hidden] norm weight
    out_ptr,  # [rows, hidden] output
    stride_xm,  # row stride of x
    stride_rm,  # row stride of residual
    stride_om,  # row stride of out
    hidden,  # number of columns
    eps,  # variance epsilon
    HAS_RESIDUAL: tl.constexpr,  # fuse the residual add
    BLOCK: tl.constexpr,  # power of two >= hidden: one program holds a whole row
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * stride_rm + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_ptr + row * stride_rm + cols, x.to(res_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_ref(x, weight, eps, residual=None):
    """Torch twin: `x * rsqrt(mean(x^2) + eps) * weight` in fp32, cast back to x's dtype.

    With `residual`, normalises `x + residual` and returns `(out, x + residual)`; unlike the
    Triton path the residual tensor is not modified in place.
    """
    h = x.float()
    if residual is not None:
        h = h + residual.float()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if residual is None:
        return out.to(x.dtype)
    return out.to(x.dtype), h.to(residual.dtype)


def _launch(x, weight, eps, residual):
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    check(x2.stride(-1) == 1, "rms_norm: the last dim of x must be contiguous")
    res2 = residual.view(-1, hidden) if residual is not None else x2
    out = torch.empty_like(x2)
    kernel = launchable(_rms_norm_kernel, x.device)
    kernel[(x2.shape[0],)](
        x2, res2, weight, out, x2.stride(0), res2.stride(0), out.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=next_pow2(hidden),
    )
    return out.view(x.shape)


def rms_norm(x, weight, eps=1e-6, residual=None, backend=None):
    """RMSNorm over the last dim. Returns `out`, or `(out, x + residual)` when `residual` is given.

    On the Triton path the residual tensor is updated in place (it must be contiguous) and
    returned as the second element, saving one write of the hidden state per layer.
    """
    check(weight.shape == (x.shape[-1],), f"rms_norm: weight {tuple(weight.shape)} != hidden {x.shape[-1]}")
    if residual is not None:
        check(residual.shape == x.shape, "rms_norm: residual must have x's shape")
    if pick_backend(x, backend) == "torch":
        return rms_norm_ref(x, weight, eps, residual)
    if residual is not None:
        check(residual.is_contiguous(), "rms_norm: the residual is updated in place and must be contiguous")
    out = _launch(x, weight, eps, residual)
    return out if residual is None else (out, residual)
