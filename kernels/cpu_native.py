"""Native CPU kernels: small C sources in `csrc/`, compiled with the system's C compiler at first use.

torch has no CPU op that attends over a paged KV cache in place: the torch path gathers every
sequence's blocks into a dense copy, then runs SDPA over it, so the cache (most of a decode step's
memory traffic once ~100 sequences run) is read three times. `paged_decode` reads each cached row
once, straight from its block.

The library is built once per source and machine (`gcc -O3 -march=native -fopenmp -ffast-math`, then
linked without -ffast-math so that loading it leaves the process's denormal handling alone; about a
second) into `$LLMOPT_CACHE_DIR/native` (default `~/.cache/llmopt/native`; the temporary directory
where that is not writable), named by a hash of the
source, the flags and the CPU's feature flags, written to a temporary name and renamed, so
concurrent first uses and interrupted builds never leave a half-written library. OpenMP binds to
the libgomp torch has already loaded (same soname), so the kernel uses torch's thread pool and
thread count. Calls go through ctypes, which releases the GIL.

No compiler or a failed build: `available()` is False and `why_unavailable()` says why; the backend
choice (`kernels.backend.select_backend`) then picks "cpu-torch" for "auto" and refuses "cpu-native".
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

_CSRC = Path(__file__).with_name("csrc")
SOURCES = [_CSRC / name for name in ("paged_decode.c", "gemv.c", "gemv_vnni.c", "ops.c", "layer.c", "dequant.c",
                                     "amx_wq.c")]
HEADERS = [_CSRC / "llmopt.h"]
# Compiled with -ffast-math (vectorised reductions and expf), linked without it: linked with it, gcc adds
# crtfastmath.o, which switches the whole process to flush-denormals-to-zero when the library loads.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC"]
LINK = ["-shared", "-fopenmp"]
LIBS = ["-lm"]  # vectorised expf comes from libmvec
_FUNCTIONS = {torch.float32: "llmopt_paged_decode_f32", torch.bfloat16: "llmopt_paged_decode_bf16"}
_reason: str | None = None


def _traced(fn):
    """Show the call as `llmopt::<name>` under torch.profiler (which cannot see into ctypes calls); free when
    no profiler runs."""
    label = f"llmopt::{fn.__qualname__.strip('_')}"

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not torch.autograd.profiler._is_profiler_enabled:
            return fn(*args, **kwargs)
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return call


def cache_dir() -> Path:
    """`$LLMOPT_CACHE_DIR`, else `$XDG_CACHE_HOME/llmopt` (default `~/.cache/llmopt`)."""
    root = os.environ.get("LLMOPT_CACHE_DIR")
    return Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmopt"


def _cpu_flags() -> str:
    """The CPU's feature line, part of the build key: -march=native code is valid only on such a CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # no procfs (not Linux): the processor name stands in
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith("flags")), platform.processor())


def _build(compiler: str) -> Path:
    source = b"".join(path.read_bytes() for path in [*SOURCES, *HEADERS])
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS, *LINK, *LIBS, platform.machine(), _cpu_flags()]).encode())
    name = f"llmopt_cpu_{key.hexdigest()[:16]}.so"
    for folder in (cache_dir() / "native", Path(tempfile.gettempdir()) / f"llmopt-native-{os.getuid()}"):
        target = folder / name
        if target.exists():
            return target
        try:  # a read-only home (some CI runners) falls back to the temporary directory
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                break
        except OSError:
            continue
    else:
        raise OSError(f"no writable folder for the native library ({cache_dir() / 'native'} or the temp dir)")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    objs = [f"{tmp[:-3]}-{path.stem}.o" for path in SOURCES]
    try:
        commands = [[compiler, *FLAGS, "-c", str(path), "-o", obj] for path, obj in zip(SOURCES, objs)]
        for command in [*commands, [compiler, *LINK, *objs, "-o", tmp, *LIBS]]:
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                raise OSError(f"{compiler} failed: {result.stderr.strip().splitlines()[-1:] or result.returncode}")
        ctypes.CDLL(tmp)  # resolves every symbol now: a library that cannot load is never cached
        os.replace(tmp, target)
    finally:
        for path in (tmp, *objs):
            if os.path.exists(path):
                os.unlink(path)
    return target


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    global _reason
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        _reason = "no C compiler (gcc or cc) on PATH"
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        _reason = str(exc)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in _FUNCTIONS.values():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64]
    i32 = ctypes.c_int
    lib.llmopt_gemv_fast.restype = i32
    lib.llmopt_gemv_fast.argtypes = []
    lib.llmopt_gemv_vnni.restype = i32
    lib.llmopt_gemv_vnni.argtypes = []
    lib.llmopt_gemv_dense.restype = i32
    lib.llmopt_gemv_dense.argtypes = [ptr, i64, ptr, i32, ptr, ptr, i64, i32, i64, i64, i64]
    lib.llmopt_gemv_w4.restype = i32
    lib.llmopt_gemv_w4.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i32, i64, i64, i64]
    lib.llmopt_gemv_w8.restype = i32
    lib.llmopt_gemv_w8.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i32, i64, i64, i64]
    for name, args in (("llmopt_add_rms_norm", [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, ctypes.c_float, i32]),
                        ("llmopt_silu_mul", [ptr, i64, ptr, i64, i64, i64, i32]),
                        ("llmopt_gelu_tanh_mul", [ptr, i64, ptr, i64, i64, i64, i32]),
                        ("llmopt_rope", [ptr, i64, ptr, i64, i64, i64, i64, i32])):
        getattr(lib, name).restype = i32
        getattr(lib, name).argtypes = args
    lib.llmopt_decode_layers.restype = i32
    lib.llmopt_decode_layers.argtypes = [ptr, i64, ptr, ptr, i64, i32, i64, i64, i64, i64, i64, ctypes.c_float, ptr,
                                         i32, ptr, i64, ptr, i64, ctypes.c_float]
    return lib


def available() -> bool:
    """The native library is built (at the first call) and loaded."""
    return _library() is not None


def why_unavailable() -> str | None:
    """Why the library is not available ("no C compiler (gcc or cc) on PATH", the compiler's error, ...),
    or None when it is."""
    _library()
    return _reason


def supports(dtype: torch.dtype) -> bool:
    """`paged_decode` runs on q and cache of this dtype here."""
    return dtype in _FUNCTIONS and available()


@_traced
def paged_decode(q: torch.Tensor, kv_rows: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 scale: float, block_size: int, out: torch.Tensor | None = None,
                 window: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged cache, read in place.

    q [B, Hq, D] (heads and dim contiguous; any token stride); kv_rows [slots, 2 * Hk * D] contiguous, a
    layer's cache with one row K || V per slot (slot = block * block_size + offset); block_tables
    [B, max_blocks] int32 with contiguous rows; context_lens [B] int32 contiguous. window: each sequence
    attends to its last `window` rows only, and rows before them are never read (None: all of them).
    Returns out [B, Hq, D] in q's dtype (fp32 or bf16, the cache's dtype too).
    """
    lib = _library()
    if lib is None:
        raise RuntimeError(f"paged_decode: {why_unavailable()}")
    b, hq, d = q.shape
    hk = kv_rows.shape[1] // (2 * d)
    if q.dtype not in _FUNCTIONS or kv_rows.dtype != q.dtype:
        raise ValueError(f"paged_decode: q and cache must share dtype fp32 or bf16, got {q.dtype} / {kv_rows.dtype}")
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    if not kv_rows.is_contiguous() or kv_rows.shape[1] != 2 * hk * d or hq % hk:
        raise ValueError(f"paged_decode: cache rows {tuple(kv_rows.shape)} do not fit q {tuple(q.shape)}")
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1 or context_lens.dtype != torch.int32 \
            or not context_lens.is_contiguous():
        raise ValueError("paged_decode: block_tables and context_lens must be int32 with contiguous rows")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"paged_decode: window must be None or a positive int, got {window!r}")
    if out is None:
        out = torch.empty(b, hq, d, dtype=q.dtype)
    if b == 0:
        return out
    rc = getattr(lib, _FUNCTIONS[q.dtype])(
        q.data_ptr(), q.stride(0), kv_rows.data_ptr(), kv_rows.stride(0), block_tables.data_ptr(),
        block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(), out.stride(0), b, hq, hk, d, block_size,
        scale, window or 0)
    if rc:
        raise ValueError(f"paged_decode: unsupported shape (heads {hq}/{hk}, head dim {d} > 1024)"
                         if rc == 1 else "paged_decode: out of memory for the score buffer")
    return out


# --- GEMV (csrc/gemv.c): decode-sized matmuls, the weight streamed once ---------------------------------
_ELEM = {torch.float32: 0, torch.bfloat16: 1}
# Up to this many rows the native GEMVs beat oneDNN (dense) and torch's int4 kernel (W4) on SmolLM2's
# shapes, 30 layers + lm_head streamed from memory, 2 threads (fp32: 21 vs 28 ms at 1 row, 26 vs 28 at 4;
# bf16: 11 vs 16 at 1, 11-13 vs 17 at 2, 16 vs 14 at 4; int4 layers: 3.8-5.1 vs 5.0-5.5 at 1, mostly
# 4.6-6.0 vs 5.8-6.3 at 2, level at 3-4; noisy machine). Int4 since the VNNI GEMV (gemv_vnni.c): the native
# GEMV beat torch's int4 kernel up to 8 rows (1.70 vs 1.84 ms at 8, before VNNI made it faster still), and
# speculative verify steps of K <= 7 drafts then stay on the fused decode step. Since the AMX-INT8 form of the
# quantized GEMVs (gemv_vnni.c, more than one row where the CPU has it) up to 16: a batch-16 decode step of the
# W4A16 + int8-embeddings SmolLM2 took 25.3 ms against 39.2 with 8 (the AMX bf16 prefill kernel above it), batch
# 12 21.4 against 34.2; at 32 rows the two are level (49.5 and 49.3 ms). 2 threads, 2026-12-06.
GEMV_MAX_ROWS = {torch.float32: 4, torch.bfloat16: 2}
W4_MAX_ROWS = 16
# int8 (30 layers): native 4.0-4.8 ms at 1 row, 15.1-16.4 at 8, against 8.6-22.9 for torch's int8 kernel
# (channel-wise) and 17.2-21.9 for the fp32 dense fallback (group-wise, which torch has no kernel for). 16 as W4.
W8_MAX_ROWS = 16


def gemv_available() -> bool:
    """The library loaded and was built with its AVX-512 paths (elsewhere the torch kernels are faster)."""
    lib = _library()
    return lib is not None and bool(lib.llmopt_gemv_fast())


def _check_rows(x: torch.Tensor, k: int, name: str) -> None:
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or x.dtype not in _ELEM or x.device.type != "cpu":
        raise ValueError(f"{name}: x must be a CPU fp32/bf16 [M, {k}] matrix with unit column stride, "
                         f"got {x.dtype} {tuple(x.shape)}")


def _bias_ptr(bias: torch.Tensor | None, n: int, name: str) -> int | None:
    if bias is None:
        return None
    if bias.dtype != torch.float32 or not bias.is_contiguous() or bias.numel() != n:
        raise ValueError(f"{name}: bias must be a contiguous fp32 vector of {n}")
    return bias.data_ptr()


TILE_ROWS = 4  # output rows per tile (csrc/gemv.c)


def _run_gemv(name: str, x: torch.Tensor, weight, call) -> torch.Tensor:
    """Check x against the weight, allocate y [M, N] in x's dtype, run `call(lib, y)` (0: done)."""
    lib = _library()
    if lib is None:
        raise RuntimeError(f"{name}: {why_unavailable()}")
    _check_rows(x, weight.in_features, name)
    y = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)
    if x.shape[0] and call(lib, y):
        raise MemoryError(f"{name}: out of memory for its buffers")
    return y


def _tiles(w: torch.Tensor, step: int) -> torch.Tensor:
    """[N, K] -> [N4 / 4, K' / step, 4, step]: tiles of 4 rows, inputs in steps, zero-padded to whole ones."""
    n, k = w.shape
    n4, kp = -(-n // TILE_ROWS) * TILE_ROWS, -(-k // step) * step
    if (n4, kp) != (n, k):
        w = torch.nn.functional.pad(w, (0, kp - k, 0, n4 - n))
    return w.reshape(n4 // TILE_ROWS, TILE_ROWS, kp // step, step).transpose(1, 2).contiguous()


class DenseWeight:
    """An fp32 or bf16 weight [N, K] copied once into csrc/gemv.c's tiled layout."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2 or weight.dtype not in _ELEM:
            raise ValueError(f"DenseWeight: an fp32/bf16 [N, K] matrix is needed, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.tiles = _tiles(weight.detach().cpu(), 16)


@_traced
def gemv(x: torch.Tensor, weight: DenseWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias, fp32) -> [M, N] in x's dtype, for a DenseWeight W (fp32 or bf16).

    Reads the weight once whatever M is; each output's arithmetic is the same for every M (batch-invariant).
    """
    def call(lib, y):
        return lib.llmopt_gemv_dense(x.data_ptr(), x.stride(0), weight.tiles.data_ptr(), _ELEM[weight.dtype],
                                     _bias_ptr(bias, y.shape[1], "gemv"), y.data_ptr(), y.shape[1], _ELEM[x.dtype],
                                     x.shape[0], y.shape[1], x.shape[1])
    return _run_gemv("gemv", x, weight, call)


class Int4Weight:
    """A W4 weight in csrc/gemv.c's tiled int4 layout: tiles of 4 rows, steps of 32 inputs, each row's 32 in
    16 bytes (input j in the low nibble of byte j, input j + 16 in its high nibble), stored values 0..15;
    fp32 scales and uint8 zero points (stored values; None for symmetric, 8) [tiles, K / group, 4]."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int):
        """q [N, K] stored values 0..15 (any integer dtype), scales [N, K / group], zeros like scales or None."""
        n, k = q.shape
        if not self.supports(k, group) or scales.shape != (n, k // group):
            raise ValueError(f"Int4Weight: group {group} must be a multiple of 32 dividing K={k}, "
                             f"scales [N, K / group] (got {tuple(scales.shape)})")
        steps = _tiles(q.to(torch.uint8), 32)  # [T, K / 32, 4, 32]
        self.tiles = (steps[..., :16] | (steps[..., 16:] << 4)).contiguous()  # [T, K / 32, 4, 16]
        self.scales = _tiles(scales.float(), 1)  # [T, G, 4, 1]
        self.zeros = None if zeros is None else _tiles(zeros.to(torch.uint8).reshape(n, k // group), 1)
        self.group, self.in_features, self.out_features = group, k, n

    @staticmethod
    def supports(in_features: int, group: int) -> bool:
        return group > 0 and group % 32 == 0 and in_features % group == 0


def _quant_gemv(name: str, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    def call(lib, y):
        zeros = None if weight.zeros is None else weight.zeros.data_ptr()
        return getattr(lib, f"llmopt_{name}")(
            x.data_ptr(), x.stride(0), weight.tiles.data_ptr(), weight.scales.data_ptr(), zeros, weight.group,
            _bias_ptr(bias, y.shape[1], name), y.data_ptr(), y.shape[1], _ELEM[x.dtype], x.shape[0], y.shape[1],
            x.shape[1])
    return _run_gemv(name, x, weight, call)


@_traced
def gemv_w4(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantized(weight).T (+ bias, fp32) -> [M, N] in x's dtype, fp32 arithmetic."""
    return _quant_gemv("gemv_w4", x, weight, bias)


class Int8Weight:
    """A W8 weight in csrc/gemv.c's tiled int8 layout: tiles of 4 rows, steps of 16 inputs (K zero-padded);
    fp32 scales and int8 zero points (None: symmetric) [tiles, groups, 4]; `group` >= K means one group
    per row (channel-wise)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int):
        """q [N, K] int8, scales [N, G], zeros like scales (int8) or None; G = 1 or K / group."""
        n, k = q.shape
        if q.dtype != torch.int8 or not self.supports(k, group) or scales.reshape(n, -1).shape[1] != max(1, k // group):
            raise ValueError(f"Int8Weight: int8 [N, K] weights with a group of K or a multiple of 16 dividing "
                             f"K={k} are needed (got {q.dtype}, group {group}, scales {tuple(scales.shape)})")
        groups = scales.reshape(n, -1).shape[1]
        self.tiles = _tiles(q, 16)
        self.scales = _tiles(scales.float().reshape(n, groups), 1)
        self.zeros = None if zeros is None else _tiles(zeros.to(torch.int8).reshape(n, groups), 1)
        self.group = k if groups == 1 else group
        self.in_features, self.out_features = k, n

    @staticmethod
    def supports(in_features: int, group: int) -> bool:
        return group >= in_features or (group > 0 and group % 16 == 0 and in_features % group == 0)


@_traced
def gemv_w8(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantized(weight).T (+ bias, fp32) -> [M, N] in x's dtype, fp32 arithmetic."""
    return _quant_gemv("gemv_w8", x, weight, bias)


# --- small per-layer ops (csrc/ops.c) -------------------------------------------------------------------
def ops_supported(dtype: torch.dtype) -> bool:
    """`add_rms_norm`, `silu_mul`, `gelu_tanh_mul` and `rope_` run on this dtype here."""
    return dtype in _ELEM and available()


def _rows_ok(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or t.stride(1) != 1 or t.dtype not in _ELEM or t.device.type != "cpu":
        raise ValueError(f"{name}: CPU fp32/bf16 [rows, n] tensors with unit column stride are needed, "
                         f"got {t.dtype} {tuple(t.shape)} strides {t.stride()}")


@_traced
def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of x [T, H] (weight [H], same dtype), or of x + residual, which is then written into
    `residual` (in place, as the Triton kernel does) and returned too: (out, residual)."""
    lib = _library()
    _rows_ok(x, "add_rms_norm")
    t, h = x.shape
    if weight.dtype != x.dtype or not weight.is_contiguous() or weight.numel() != h:
        raise ValueError(f"add_rms_norm: weight must be a contiguous {x.dtype} vector of {h}")
    if residual is not None:
        _rows_ok(residual, "add_rms_norm")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("add_rms_norm: residual must match x")
    out = torch.empty(t, h, dtype=x.dtype)
    lib.llmopt_add_rms_norm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                            0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(), h,
                            t, h, eps, _ELEM[x.dtype])
    return out if residual is None else (out, residual)


def _gated(name: str, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up by the C function `name` for the fused gate||up rows [T, 2I] -> [T, I]."""
    lib = _library()
    _rows_ok(gate_up, name)
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype)
    getattr(lib, f"llmopt_{name}")(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), inter, t, inter,
                                   _ELEM[gate_up.dtype])
    return out


@_traced
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the fused gate||up rows [T, 2I] -> [T, I]."""
    return _gated("silu_mul", gate_up)


@_traced
def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up for the fused gate||up rows [T, 2I] -> [T, I] (in bf16 the gelu is
    rounded before the product, as transformers' MLP rounds it)."""
    return _gated("gelu_tanh_mul", gate_up)


@_traced
def rope_(x: torch.Tensor, cos_sin: torch.Tensor, head_dim: int) -> None:
    """Rotate-half RoPE in place on x [T, heads * head_dim] (rows may be strided); cos_sin [T, head_dim] =
    cos || sin of each token's position, in x's dtype."""
    lib = _library()
    _rows_ok(x, "rope_")
    _rows_ok(cos_sin, "rope_")
    t, width = x.shape
    if width % head_dim or head_dim % 2 or cos_sin.shape != (t, head_dim) or cos_sin.dtype != x.dtype:
        raise ValueError(f"rope_: x {tuple(x.shape)} and cos_sin {tuple(cos_sin.shape)} do not fit head dim "
                         f"{head_dim}")
    lib.llmopt_rope(x.data_ptr(), x.stride(0), cos_sin.data_ptr(), cos_sin.stride(0), t, width // head_dim, head_dim,
                    _ELEM[x.dtype])


# --- a decode step's decoder layers in one call (csrc/layer.c) ------------------------------------------
class _Linear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("welem", ctypes.c_int64), ("weight", ctypes.c_void_p),
                ("scales", ctypes.c_void_p), ("zeros", ctypes.c_void_p), ("group", ctypes.c_int64),
                ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("attn_out_norm", ctypes.c_void_p), ("mlp_out_norm", ctypes.c_void_p),
                ("group", ctypes.c_int64), ("cache_slot", ctypes.c_int64)]


class _Group(ctypes.Structure):
    _fields_ = [("slots", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("bt_stride", ctypes.c_int64),
                ("cos_sin", ctypes.c_void_p), ("window", ctypes.c_int64)]


@dataclass(frozen=True)
class DecodeLayer:
    """One decoder layer for `llmopt_decode_layers`: its four linears, its norms (None where the family has
    none), its KV layer group and its slot in the cache's first dimension."""

    qkv: _Linear
    o: _Linear
    gate_up: _Linear
    down: _Linear
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    group: int = 0
    cache_slot: int = 0

    def struct(self) -> _Layer:
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        return _Layer(self.qkv, self.o, self.gate_up, self.down, ptr(self.input_norm), ptr(self.post_norm),
                      ptr(self.q_norm), ptr(self.k_norm), ptr(self.attn_out_norm), ptr(self.mlp_out_norm),
                      self.group, self.cache_slot)


@dataclass(frozen=True)
class GroupStep:
    """A KV layer group's part of a decode step: its cache slots [M] int64, block tables [M, max_blocks] int32,
    RoPE rows [M, head_dim] and window (None: all keys)."""

    slots: torch.Tensor
    block_tables: torch.Tensor
    cos_sin: torch.Tensor
    window: int | None


def linear_desc(weight: "DenseWeight | Int4Weight | Int8Weight", bias: torch.Tensor | None) -> _Linear:
    """The C description of a prepared native weight (and fp32 bias): pointers only, the caller keeps the
    tensors alive."""
    b = _bias_ptr(bias, weight.out_features, "linear_desc")
    if isinstance(weight, DenseWeight):
        return _Linear(0, _ELEM[weight.dtype], weight.tiles.data_ptr(), None, None, 0, b, weight.out_features,
                       weight.in_features)
    zeros = None if weight.zeros is None else weight.zeros.data_ptr()
    return _Linear(1 if isinstance(weight, Int4Weight) else 2, 0, weight.tiles.data_ptr(), weight.scales.data_ptr(),
                   zeros, weight.group, b, weight.out_features, weight.in_features)


class DecodeLayers:
    """A runtime's decoder layers described for `llmopt_decode_layers`, which runs them all for a decode
    step's tokens in one call. `keep` holds every tensor the descriptions point into."""

    def __init__(self, layers: list[DecodeLayer], dtype: torch.dtype, hidden: int, heads: int, kv_heads: int,
                 head_dim: int, inter: int, eps: float, keep: list, max_rows: int, gelu: bool = False):
        """`max_rows`: the most sequences a step may have (the smallest row limit of the layers' GEMVs); gelu:
        GeGLU (Gemma), else SwiGLU."""
        self.array = (_Layer * len(layers))(*[layer.struct() for layer in layers])
        self.groups = 1 + max(layer.group for layer in layers)
        self.keep = keep
        self.dtype, self.hidden, self.heads, self.kv_heads = dtype, hidden, heads, kv_heads
        self.head_dim, self.inter, self.eps, self.max_rows, self.gelu = head_dim, inter, eps, max_rows, gelu

    @_traced
    def run(self, residual: torch.Tensor, groups: list[GroupStep], kv_cache: torch.Tensor,
            context_lens: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
        """residual [M, H] contiguous: the embeddings in, the residual stream after the last layer out (in
        place); returns the last layer's MLP output [M, H]. groups: each KV layer group's part of the step;
        kv_cache [slots, ..., 2 * Hk * D] contiguous (a layer's rows at its cache_slot); context_lens [M] int32."""
        lib = _library()
        m = residual.shape[0]
        if not residual.is_contiguous() or residual.dtype != self.dtype or kv_cache.dtype != self.dtype \
                or not kv_cache.is_contiguous() or len(groups) != self.groups or not context_lens.is_contiguous() \
                or any(not _fits_group(g, m, self.head_dim) for g in groups):
            raise ValueError("decode_layers: tensors do not fit the runtime (dtype, layout or shape)")
        described = (_Group * len(groups))(*[_Group(g.slots.data_ptr(), g.block_tables.data_ptr(),
                                                    g.block_tables.stride(0), g.cos_sin.data_ptr(), g.window or 0)
                                             for g in groups])
        out = torch.empty_like(residual)
        rc = lib.llmopt_decode_layers(
            self.array, len(self.array), residual.data_ptr(), out.data_ptr(), m, _ELEM[self.dtype], self.hidden,
            self.heads, self.kv_heads, self.head_dim, self.inter, self.eps, described, int(self.gelu),
            kv_cache.data_ptr(), kv_cache[0].numel(), context_lens.data_ptr(), block_size, scale)
        if rc:
            raise RuntimeError(f"decode_layers failed (code {rc})")
        return out


def _fits_group(g: GroupStep, m: int, head_dim: int) -> bool:
    return g.slots.dtype == torch.int64 and g.slots.is_contiguous() and g.cos_sin.shape == (m, head_dim) \
        and g.cos_sin.is_contiguous() and g.block_tables.stride(1) == 1


def native_function(name: str, argtypes: list, restype=ctypes.c_int):
    """The library's C function `name` with its ctypes signature set (for kernels bound outside this module),
    or None where the library is not available."""
    lib = _library()
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn
