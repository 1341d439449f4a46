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

No compiler, a failed build or `LLMOPT_NATIVE=0`: `available()` is False and callers keep the torch
path (`why_unavailable()` says why).
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
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
# Compiled with -ffast-math (vectorised reductions and expf), linked without it: linked with it, gcc adds
# crtfastmath.o, which switches the whole process to flush-denormals-to-zero when the library loads.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC"]
LINK = ["-shared", "-fopenmp"]
LIBS = ["-lm"]  # vectorised expf comes from libmvec
_FUNCTIONS = {torch.float32: "llmopt_paged_decode_f32", torch.bfloat16: "llmopt_paged_decode_bf16"}
_reason: str | None = None


def cache_dir() -> Path:
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
    source = SOURCE.read_bytes()
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
    obj = tmp[:-3] + ".o"
    try:
        for command in ([compiler, *FLAGS, "-c", str(SOURCE), "-o", obj], [compiler, *LINK, obj, "-o", tmp, *LIBS]):
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                raise OSError(f"{compiler} failed: {result.stderr.strip().splitlines()[-1:] or result.returncode}")
        ctypes.CDLL(tmp)  # resolves every symbol now: a library that cannot load is never cached
        os.replace(tmp, target)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    return target


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    global _reason
    if os.environ.get("LLMOPT_NATIVE", "1") == "0":
        _reason = "disabled by LLMOPT_NATIVE=0"
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        _reason = "no C compiler (gcc or cc) on PATH"
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        _reason = f"native kernels not built: {exc}"
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in _FUNCTIONS.values():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float]
    return lib


def available() -> bool:
    return _library() is not None


def why_unavailable() -> str | None:
    _library()
    return _reason


def supports(dtype: torch.dtype) -> bool:
    return dtype in _FUNCTIONS and available()


def paged_decode(q: torch.Tensor, kv_rows: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 scale: float, block_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged cache, read in place.

    q [B, Hq, D] (heads and dim contiguous; any token stride); kv_rows [slots, 2 * Hk * D] contiguous, a
    layer's cache with one row K || V per slot (slot = block * block_size + offset); block_tables
    [B, max_blocks] int32 with contiguous rows; context_lens [B] int32 contiguous.
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
    if out is None:
        out = torch.empty(b, hq, d, dtype=q.dtype)
    if b == 0:
        return out
    rc = getattr(lib, _FUNCTIONS[q.dtype])(
        q.data_ptr(), q.stride(0), kv_rows.data_ptr(), kv_rows.stride(0), block_tables.data_ptr(),
        block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(), out.stride(0), b, hq, hk, d, block_size,
        scale)
    if rc:
        raise ValueError(f"paged_decode: unsupported shape (heads {hq}/{hk}, head dim {d} > 1024)"
                         if rc == 1 else "paged_decode: out of memory for the score buffer")
    return out
