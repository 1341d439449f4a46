"""Shared tolerances, markers and quantized-weight builders for the kernel tests."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

# (atol, rtol) for kernel vs twin at the same dtype. The interpreter only runs fp32 (its bf16
# arithmetic is wrong); fp16/bf16 run on CUDA, where scripts/gpu_check.sh runs this suite.
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def device_dtypes():
    """(device, dtype) pairs for the Triton path: fp32 on CPU (interpreter), all three on CUDA."""
    pairs = [("cpu", torch.float32)]
    if torch.cuda.is_available():
        pairs += [("cuda", dt) for dt in (torch.float32, torch.float16, torch.bfloat16)]
    return pairs


def runs_in_this_process(item, cuda: bool) -> bool:
    """Whether a kernel test runs in the pytest process itself. Interpreted and compiled Triton launches never share
    a process (`llmopt.kernels._backend` refuses the second kind), so with CUDA this process keeps the CUDA cases:
    the `device_dtype` cases on cuda, and tests without that parameter that say "cuda" in their name (or carry the
    `with_cuda_cases` marker). The rest (interpreted launches on CPU tensors, and whatever launches nothing) run in
    a subprocess with CUDA hidden (`test_compile.py::test_interpreted_cases_in_their_own_process`). Without CUDA
    every test runs here."""
    if not cuda:
        return True
    spec = getattr(item, "callspec", None)
    device = spec.params.get("device_dtype", (None,))[0] if spec is not None else None
    if device is not None:
        return device == "cuda"
    return "cuda" in item.name.lower() or item.get_closest_marker("with_cuda_cases") is not None


def assert_close(actual, expected, dtype, scale=1.0):
    """allclose with the dtype's (atol, rtol); atol scaled by the output's magnitude."""
    atol, rtol = TOLERANCES[dtype]
    bad = ~torch.isclose(actual.float(), expected.float(), atol=atol * scale, rtol=rtol)
    assert not bad.any(), (f"{int(bad.sum())}/{bad.numel()} mismatches, max abs err "
                           f"{(actual.float() - expected.float()).abs().max().item():.3g}")


def pack_int4(q: torch.Tensor, packed_dim: int = 1) -> torch.Tensor:
    """int8 values in [-8, 7] -> int32 words of 8 (stored +8, element 8c+j in bits 4j), as
    compressed-tensors packs them (test_int4_layout_matches_compressed_tensors checks this)."""
    if packed_dim == 0:
        return pack_int4(q.t()).t().contiguous()
    n, k = q.shape
    v = torch.nn.functional.pad(q.long() + 8, (0, -k % 8)).view(n, -1, 8)
    words = (v << torch.arange(0, 32, 4)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize_int4(w: torch.Tensor, group_size: int | None, symmetric: bool):
    """compressed-tensors pack-quantized tensors for a float weight [N, K] (group None: channel)."""
    n, k = w.shape
    g = k if group_size is None else group_size
    groups = -(-k // g)
    wg = torch.nn.functional.pad(w.float(), (0, groups * g - k)).view(n, groups, g)
    if symmetric:
        scale = wg.abs().amax(-1).clamp_min(1e-8) / 7.5
        zp = torch.zeros_like(scale)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp_min(1e-8)
        zp = (-8 - lo / scale).round().clamp(-8, 7)
    q = (wg / scale[..., None] + zp[..., None]).round().clamp(-8, 7).flatten(1)[:, :k].to(torch.int8)
    out = {"weight_packed": pack_int4(q), "weight_scale": scale,
           "weight_shape": torch.tensor([n, k])}
    if not symmetric:
        out["weight_zero_point"] = pack_int4(zp.to(torch.int8), packed_dim=0)
    return out


def quantize_int8(w: torch.Tensor, symmetric: bool = True):
    """Channel-wise int8 tensors ({weight, weight_scale[, weight_zero_point]}) for w [N, K]."""
    if symmetric:
        scale = w.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
        return {"weight": (w / scale).round().clamp(-127, 127).to(torch.int8), "weight_scale": scale}
    lo, hi = w.amin(-1, keepdim=True).clamp(max=0), w.amax(-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / 255).clamp_min(1e-8)
    zp = (-128 - lo / scale).round().clamp(-128, 127)
    q = (w / scale + zp).round().clamp(-128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale, "weight_zero_point": zp.to(torch.int8)}


def to(tensors: dict, device) -> dict:
    return {name: t.to(device) for name, t in tensors.items()}


# Before kineto's first start in this process: otherwise every trace prints "USDT: profiler_start" lines.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
KERNELS = ("llmopt::", "mkldnn::", "aten::mm", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm",
           "quantized::linear_dynamic", "aten::linear")


def kernel_calls(fn, prefixes=KERNELS) -> list[tuple[str, list]]:
    """(name, input shapes) of the kernels `fn()` ran, in order, as torch.profiler records them: native calls as
    `llmopt::<name>`, oneDNN's linear as `mkldnn::_linear_pointwise` ([rows, K], weight [N, K], bias, ...)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [(e.name, e.input_shapes) for e in prof.events() if e.name.startswith(prefixes)]


def kernel_names(fn, prefixes=KERNELS) -> list[str]:
    """The names of the kernels `fn()` ran, in order (see `kernel_calls`)."""
    return [name for name, _ in kernel_calls(fn, prefixes)]
