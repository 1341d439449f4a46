"""Gated activations on the fused gate||up projection output: SwiGLU `silu(gate) * up` (Llama) and GeGLU
`gelu(gate, approximate="tanh") * up` (Gemma)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import cdiv, check, jit, launchable, pick_backend, tl


@jit
def _gated_kernel(
    x_ptr,  # [rows, 2 * inter] gate in the first half of each row, up in the second
    out_ptr,  # [rows, inter] output
    stride_xm,  # row stride of x
    stride_om,  # row stride of out
    inter,  # intermediate size (half of x's last dim)
    GELU: tl.constexpr,  # False: silu(gate) * up (SwiGLU); True: gelu_tanh(gate) * up (GeGLU)
    BLOCK: tl.constexpr,  # columns per program
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xm + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        # (1 + tanh(u)) / 2 = sigmoid(2u), taken as e / (1 + e) with e = exp(-|2u|): no tanh in every Triton's
        # `tl`, no overflow, and no cancellation of 1 + tanh(u) in the negative tail.
        x = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)  # 2u = 2 sqrt(2 / pi) (g + 0.044715 g^3)
        e = tl.exp(-tl.abs(x))
        out = gate * (tl.where(x >= 0, 1.0, e) / (1.0 + e)) * up
    else:
        out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_om + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_ref(x):
    """Torch twin: `silu(x[..., :I]) * x[..., I:]`, computed in fp32."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def gelu_tanh_and_mul_ref(x):
    """Torch twin: `gelu(x[..., :I], approximate="tanh") * x[..., I:]`, computed in fp32."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(x.dtype)


def _launch_gated(gelu: bool, name, x):
    """Launch a gated-activation kernel on x [..., 2I] -> [..., I]."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    check(x2.stride(-1) == 1, f"{name}: the last dim of x must be contiguous")
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    block = 1024
    grid = (x2.shape[0], cdiv(inter, block))
    launchable(_gated_kernel, x.device)[grid](x2, out, x2.stride(0), out.stride(0), inter, GELU=gelu, BLOCK=block)
    return out.view(*x.shape[:-1], inter)


def silu_and_mul(x, backend=None):
    """SwiGLU on `x` = gate||up of shape [..., 2*I]; returns [..., I]."""
    check(x.shape[-1] % 2 == 0, f"silu_and_mul: last dim {x.shape[-1]} must be even (gate||up)")
    if pick_backend(x, backend) == "torch":
        return silu_and_mul_ref(x)
    return _launch_gated(False, "silu_and_mul", x)


def gelu_tanh_and_mul(x, backend=None):
    """GeGLU on `x` = gate||up of shape [..., 2*I]: gelu(gate, approximate="tanh") * up; returns [..., I]."""
    check(x.shape[-1] % 2 == 0, f"gelu_tanh_and_mul: last dim {x.shape[-1]} must be even (gate||up)")
    if pick_backend(x, backend) == "torch":
        return gelu_tanh_and_mul_ref(x)
    return _launch_gated(True, "gelu_tanh_and_mul", x)
