"""`llmopt profile SOURCE --kernels`: one decode step's matmuls on SOURCE's shapes, per weight scheme.

For every linear of one decode step (--layers x the model family's Linears: q, k, v, o, gate, up, down, or
Phi-3's fused q+k+v, o, gate+up, down; plus the lm_head; only config.json is read, the weights are random)
this times dense F.linear (fp32, bf16) against the linears the quantized layers run (W8A16: int8
weight-only, W8A8: per-token int8, W4A16: int4 weight-only, group 64). Every layer gets its own
weights, as in a real step, so they stream from memory rather than cache; shapes that coincide (q and
o of a square attention) are timed together. Reported: per shape and row count (--batch-sizes) the
median per call (--repeats) with the weight bytes it moved per second, the summed step, and each
scheme's error against an fp64 reference.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..progress import StageHooks
from .config import ProfileConfig
from .tables import TableData

SCHEMES = ("fp32", "bf16", "w8a16", "w8a8", "w4a16")
GROUP = 64
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "w8a16": 1.0, "w8a8": 1.0, "w4a16": 0.5 + 2 / GROUP}
LM_HEAD_COPIES = 3  # more than a last-level cache holds of a 576 x 49152 lm_head


def step_shapes(spec, layers: int) -> dict[str, tuple[int, int, int]]:
    """{name: (K, N, calls per decode step)}: the decoder's projections (a fused one named by its sections,
    q+k+v), equal shapes merged, and the lm_head."""
    from .costs import layer_linear_shapes

    per_layer = {}
    sections = spec.family.sections()
    for linear, (n, k) in layer_linear_shapes(spec).items():
        names, count = per_layer.get((k, n), ([], 0))
        per_layer[(k, n)] = (names + ["+".join(sections[linear])], count + 1)
    shapes = {"/".join(names): (k, n, count * layers) for (k, n), (names, count) in per_layer.items()}
    return shapes | {"lm_head": (spec.hidden_size, spec.vocab_size, 1)}


def quantized(w: torch.Tensor) -> dict:
    """Symmetric int4 (group 64, pack-quantized) and int8 (per channel) tensors of w [N, K]."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    n, k = w.shape
    s4 = w.view(n, k // GROUP, GROUP).abs().amax(-1) / 7.5
    q4 = (w.view(n, k // GROUP, GROUP) / s4[..., None]).round().clamp(-8, 7).view(n, k).to(torch.int8)
    s8 = w.abs().amax(-1, keepdim=True) / 127
    q8 = (w / s8).round().clamp(-127, 127).to(torch.int8)
    return {"w4": {"weight_packed": pack_to_int32(q4, 4), "weight_scale": s4, "weight_shape": torch.tensor([n, k])},
            "w8": {"weight": q8, "weight_scale": s8}}


def linears(w: torch.Tensor) -> dict:
    """Every scheme's callable x -> y for the float weight w [N, K]."""
    from ...kernels import W4A16Linear, W8A8Linear, W8A16Linear

    t = quantized(w)
    bf16 = w.bfloat16()
    return {"fp32": lambda x: F.linear(x, w), "bf16": lambda x: F.linear(x.bfloat16(), bf16).float(),
            "w8a16": W8A16Linear.from_compressed(t["w8"]), "w8a8": W8A8Linear.from_compressed(t["w8"]),
            "w4a16": W4A16Linear.from_compressed(t["w4"], group_size=GROUP)}


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_shape(k: int, n: int, copies: int, batches, repeats: int) -> dict[int, dict[str, float]]:
    """{rows: {scheme: microseconds per call}} over `copies` independent layers of shape [n, k]."""
    layers = [linears(torch.randn(n, k) * 0.02) for _ in range(copies)]
    times = {}
    for m in batches:
        x = torch.randn(m, k)
        times[m] = {s: median_s(lambda: [layer[s](x) for layer in layers], repeats) / copies * 1e6 for s in SCHEMES}
    return times


def accuracy(k: int, n: int, m: int = 8) -> dict[str, tuple[float, float]]:
    """Per scheme: relative error against fp64 x @ W.T of the float weight, and against fp64 with the
    scheme's own quantized weight (what the kernel adds on top of quantizing the weight)."""
    from ...kernels import w4a16_dequantize

    w, x = torch.randn(n, k) * 0.02, torch.randn(m, k)
    t, x64 = quantized(w), x.double()
    w8 = t["w8"]["weight"].double() * t["w8"]["weight_scale"].double()
    w4 = w4a16_dequantize(t["w4"]["weight_packed"], t["w4"]["weight_scale"], k, None, GROUP, torch.float64)
    exact = x64 @ w.double().t()
    own = {"fp32": exact, "bf16": exact, "w8a16": x64 @ w8.t(), "w8a8": x64 @ w8.t(), "w4a16": x64 @ w4.t()}

    def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
        return ((y.double() - ref).norm() / ref.norm()).item()

    return {s: (rel(f(x), exact), rel(f(x), own[s])) for s, f in linears(w).items()}


def run_matmuls(source: str, config: ProfileConfig, hooks: StageHooks | None = None) -> dict:
    """Time every scheme on `source`'s shapes (see the module docstring); returns the report."""
    from ..serve.loader import locate, read_config
    from ..serve.model import spec_from_config
    from .machine import copy_bandwidth, describe

    hooks = hooks or StageHooks()
    spec = spec_from_config(read_config(locate(source)[0]))
    layers = config.layers or spec.num_layers
    shapes = step_shapes(spec, layers)
    if any(k % GROUP for k, _, _ in shapes.values()):
        raise ConfigError(f"--kernels: {source}'s input sizes must be multiples of the int4 group size {GROUP}")
    load = os.getloadavg()[0]  # a busy core makes every multi-threaded op wait for a time slice
    copy = copy_bandwidth(torch.device("cpu"), config.copy_mib)
    torch.manual_seed(0)
    timed = {}
    with torch.inference_mode():
        for name, (k, n, calls) in shapes.items():
            hooks.status(f"{name} {k}x{n}: {calls} calls per step")
            timed[name] = time_shape(k, n, LM_HEAD_COPIES if name == "lm_head" else layers, config.batch_sizes,
                                     config.repeats)
        errors = accuracy(spec.hidden_size, spec.intermediate_size)
    step = {m: {s: sum(timed[name][m][s] * calls for name, (_, _, calls) in shapes.items()) for s in SCHEMES}
            for m in config.batch_sizes}
    return {"tool": "llmopt profile --kernels", "source": source, "layers": layers, "machine": {**describe(
        torch.device("cpu")), "copy": copy, "load_average": load},
            "shapes": {name: {"k": k, "n": n, "calls_per_step": c, "us": timed[name]} for name, (k, n, c) in shapes.items()},
            "step_us": step, "accuracy": {s: {"vs_weight": a, "vs_own": b} for s, (a, b) in errors.items()},
            "accuracy_shape": [spec.hidden_size, spec.intermediate_size, 8], "config": config.to_dict()}


def matmul_tables(report: dict) -> list[TableData]:
    m = report["machine"]
    shapes = TableData("matmuls", f"one decode step's matmuls on {report['source']}'s shapes, {report['layers']} layers,"
                                  f" {m['threads']} thread(s)", ["shape (K x N)", "M",
                                                                 *(f"{s} us (GB/s)" for s in SCHEMES)])
    for name, shape in report["shapes"].items():
        for rows, us in shape["us"].items():
            gbps = {s: shape["k"] * shape["n"] * WEIGHT_BYTES[s] / (us[s] * 1e-6) / 1e9 for s in SCHEMES}
            shapes.rows.append([f"{name} {shape['k']}x{shape['n']}", str(rows),
                                *(f"{us[s]:.0f} ({gbps[s]:.1f})" for s in SCHEMES)])
    shapes.note = (f"copy bandwidth {m['copy']['bytes_per_s'] / 1e9:.1f} GB/s (read + written); load average "
                   f"{m['load_average']:.1f} at the start (other processes slow every multi-threaded op)")
    step = TableData("matmul-step", "one decode step, every linear (per-shape medians x calls per step)",
                     ["M", *(f"{s} ms" for s in SCHEMES), "w8a16/fp32", "w8a8/fp32", "w4a16/fp32"])
    for rows, us in report["step_us"].items():
        step.rows.append([str(rows), *(f"{us[s] / 1e3:.2f}" for s in SCHEMES),
                          *(f"{us[s] / us['fp32']:.2f}" for s in ("w8a16", "w8a8", "w4a16"))])
    k, n, rows = report["accuracy_shape"]
    acc = TableData("matmul-accuracy", f"accuracy at {k}x{n}, M={rows} (relative Frobenius error against fp64)",
                    ["scheme", "vs the float weight", "vs its own quantized weight"])
    acc.rows = [[s, f"{e['vs_weight']:.2e}", f"{e['vs_own']:.2e}"] for s, e in report["accuracy"].items()]
    return [shapes, step, acc]
