"""`llmopt profile --synthetic SHAPE --kernel-speed`: the quantized matmuls and paged decode attention on a
model shape's matrices, against the dense matmul, as shares of the copy bandwidth measured in the same run.

Matmuls: x [M, K] times the weights of a square (hidden x hidden) and a wide (hidden x intermediate)
projection, at each M of --batch-sizes (preset 1, 16, 64), in --dtype (preset fp16): dense `F.linear`
(cuBLAS on CUDA), W4A16 and W8A16 (symmetric, group 128 or what divides K, the layouts `llmopt quantize`
writes) and W8A8 (per-channel int8 weights, per-token int8 activations), each through the public kernel
entry point for the tensor's device (Triton on CUDA, the torch twin elsewhere). Paged decode attention:
a batch of 32 sequences of --decode-context (preset 2048) cached tokens with the shape's heads, block 16.

Times are medians: `triton.testing.do_bench` on CUDA (L2 flushed between calls, so weights stream from
memory as in a decode step), else the median of --repeats timed calls after a warm-up. A kernel's bytes
are what it must read at least (weights and scales; attention: the cached keys and values), its share
that over the time as a fraction of the copy bandwidth (machine.py, STREAM convention).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..progress import StageHooks
from .config import SYNTHETIC_SHAPES, ProfileConfig
from .machine import synchronize
from .tables import TableData

SCHEMES = ("dense", "w4a16", "w8a16", "w8a8")
GROUPS = (128, 64, 32)
ATTENTION_BATCH, BLOCK = 32, 16


def median_us(fn, device: torch.device, repeats: int) -> float:
    """Median microseconds of one call of `fn`."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, return_mode="median") * 1e3
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def matmuls(n: int, k: int, device: torch.device, dtype: torch.dtype) -> tuple[dict, dict]:
    """({scheme: x -> y}, {scheme: bytes read per call}) for random weights [n, k] in every scheme."""
    from llmopt.kernels import w4a16_matmul, w8a8_matmul, w8a16_matmul

    group = next((g for g in GROUPS if k % g == 0), None)
    if group is None:
        raise ConfigError(f"--kernel-speed: the input size {k} is not a multiple of 32")
    g = torch.Generator(device=device).manual_seed(n + k)
    dense = (torch.randn(n, k, generator=g, device=device) * 0.02).to(dtype)
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=g, device=device, dtype=torch.int32)
    q8 = torch.randint(-127, 128, (n, k), generator=g, device=device, dtype=torch.int8)
    s_group = (torch.rand(n, k // group, generator=g, device=device) * 0.01).to(dtype)
    s_channel = (torch.rand(n, 1, generator=g, device=device) * 0.01).to(dtype)
    calls = {"dense": lambda x: F.linear(x, dense),
             "w4a16": lambda x: w4a16_matmul(x, packed, s_group, None, group),
             "w8a16": lambda x: w8a16_matmul(x, q8, s_group, None, group),
             "w8a8": lambda x: w8a8_matmul(x, q8, s_channel)}
    nbytes = {"dense": dense.nbytes, "w4a16": packed.nbytes + s_group.nbytes, "w8a16": q8.nbytes + s_group.nbytes,
              "w8a8": q8.nbytes + s_channel.nbytes}
    return calls, nbytes


def time_matmuls(n: int, k: int, config: ProfileConfig, device, dtype, copy_bps: float) -> list[dict]:
    """One row per M: each scheme's median us, its share of the copy bandwidth and speed-up over dense."""
    calls, nbytes = matmuls(n, k, device, dtype)
    rows = []
    for m in config.batch_sizes:
        x = torch.randn(m, k, device=device).to(dtype)
        us = {s: median_us(lambda: calls[s](x), device, config.repeats) for s in SCHEMES}
        rows.append({"k": k, "n": n, "m": m, "us": us, "bytes": nbytes,
                     "share": {s: nbytes[s] / (us[s] * 1e-6) / copy_bps for s in SCHEMES},
                     "speedup": {s: us["dense"] / us[s] for s in SCHEMES}})
    return rows


def time_attention(shape: str, context: int, device, dtype, repeats: int, copy_bps: float) -> dict:
    """Paged decode attention of ATTENTION_BATCH sequences of `context` cached tokens (shuffled blocks)."""
    from llmopt.kernels import paged_attention_decode

    _, _, hq, hk, d, _ = SYNTHETIC_SHAPES[shape]
    per_seq = -(-context // BLOCK)
    blocks = ATTENTION_BATCH * per_seq
    k_cache = torch.randn(blocks, BLOCK, hk, d, device=device).to(dtype)  # [blocks, block, Hk, D]
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(blocks, device=device).to(torch.int32).view(ATTENTION_BATCH, per_seq)
    lens = torch.full((ATTENTION_BATCH,), context, device=device, dtype=torch.int32)
    q = torch.randn(ATTENTION_BATCH, hq, d, device=device).to(dtype)  # [S, Hq, D]
    us = median_us(lambda: paged_attention_decode(q, k_cache, v_cache, tables, lens, d ** -0.5), device, repeats)
    nbytes = 2 * ATTENTION_BATCH * context * hk * d * dtype.itemsize
    return {"batch": ATTENTION_BATCH, "context": context, "heads": hq, "kv_heads": hk, "head_dim": d,
            "block_size": BLOCK, "us": us, "bytes": nbytes, "share": nbytes / (us * 1e-6) / copy_bps}


def run_kernel_speed(config: ProfileConfig, hooks: StageHooks | None = None) -> dict:
    """The kernel speed table on `config.synthetic`'s shapes (see the module docstring)."""
    from ..model_io import parse_dtype
    from .machine import copy_bandwidth, describe

    hooks = hooks or StageHooks()
    device, dtype = torch.device(config.device), parse_dtype(config.dtype) or torch.float16
    hidden, inter = SYNTHETIC_SHAPES[config.synthetic][:2]
    copy = copy_bandwidth(device, config.copy_mib)
    hooks.status(f"copy bandwidth {copy['bytes_per_s'] / 1e9:.0f} GB/s on {device}")
    rows = []
    with torch.inference_mode():
        for n, k in ((hidden, hidden), (inter, hidden)):
            hooks.status(f"matmuls {k}x{n}")
            rows += time_matmuls(n, k, config, device, dtype, copy["bytes_per_s"])
        attention = time_attention(config.synthetic, config.decode_context, device, dtype, config.repeats,
                                   copy["bytes_per_s"])
    return {"tool": "llmopt profile --synthetic --kernel-speed", "shape": config.synthetic, "dtype": str(dtype),
            "machine": {**describe(device), "copy": copy}, "matmuls": rows, "attention": attention,
            "config": config.to_dict()}


def kernel_speed_tables(report: dict) -> list[TableData]:
    dtype, m = report["dtype"].removeprefix("torch."), report["machine"]
    t = TableData("kernel-speed", f"matmuls on {report['shape']}'s matrices, {dtype}, {m['device']} "
                                  f"(us; speed-up over dense; share of the copy bandwidth)",
                  ["K x N", "M", "dense us", "w4a16", "w8a16", "w8a8"])
    for r in report["matmuls"]:
        cells = [f"{r['us'][s]:.1f} ({r['speedup'][s]:.2f}x, {r['share'][s]:.0%})" for s in SCHEMES[1:]]
        dense = f"{r['us']['dense']:.1f} ({r['share']['dense']:.0%})"
        t.rows.append([f"{r['k']}x{r['n']}", str(r["m"]), dense, *cells])
    a = report["attention"]
    t.note = (f"copy bandwidth {m['copy']['bytes_per_s'] / 1e9:.0f} GB/s (read + written). Paged decode attention, "
              f"batch {a['batch']}, context {a['context']}, {a['heads']}/{a['kv_heads']} heads x {a['head_dim']}, "
              f"block {a['block_size']}: {a['us']:.1f} us, {a['bytes'] / (a['us'] * 1e-6) / 1e9:.0f} GB/s = "
              f"{a['share']:.0%} of the copy bandwidth")
    return [t]
