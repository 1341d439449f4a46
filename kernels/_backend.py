"""Op-level dispatch shared by every op (`backend=None|"triton"|"torch"`; None: Triton for CUDA tensors,
the torch twin otherwise) and the Triton launch plumbing. Which kernels a model runs is decided once by
its `Backend` (`backend.py`), which always passes the op backend explicitly.

Triton is imported at the first launch, not with the kernel modules (`_triton`: `jit`, `tl` and `constexpr`
are stand-ins until then), so that a process that launches none, or a machine without triton, imports every
kernel module without it. The choice of interpreter vs compiler is made per launch from the tensors' device,
not from the process environment at import time: a CPU tensor can only run under Triton's interpreter, a CUDA
tensor only compiled. That keeps tests correct whatever order modules were imported in. One process runs
kernels one way only: the first launch fixes it, and a launch the other way is a KernelBackendError (the
interpreter rewires triton.language, which breaks later compiled launches).
`recording` turns launches into records of what would be launched (`compile_check`).
"""
from __future__ import annotations

import contextlib
import functools

import torch

# `jit`, `tl` and `constexpr` are the kernel modules' (stand-ins until the first launch: `_triton`).
from ._triton import LazyKernel, available, constexpr, jit, language, stdlib_interpreted, tl

OP_BACKENDS = ("triton", "torch")


class KernelBackendError(RuntimeError):
    """A backend was asked for that cannot run here (say, triton without triton installed)."""


def pick_backend(x: torch.Tensor, backend: str | None) -> str:
    """`backend` if given, else "triton" for CUDA tensors (when triton is installed) and "torch" otherwise."""
    if backend is None:
        return "triton" if x.is_cuda and available() else "torch"
    if backend not in OP_BACKENDS:
        raise KernelBackendError(f"unknown kernel backend {backend!r}; use one of {OP_BACKENDS} or None")
    if backend == "triton" and not available():
        raise KernelBackendError("backend='triton' needs the triton package: pip install triton")
    return backend


@functools.lru_cache(maxsize=None)
def _interpreted(fn):
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    from triton.runtime.jit import JITFunction

    return JITFunction(fn)


# How this process has launched Triton kernels so far: None, "interpreted" or "compiled". One process does one
# or the other, never both: the interpreter rewires triton.language while it runs (and `_interpreter_compat`
# more), and compiled launches after it fail with errors from deep inside the compiler.
_launch_kind: str | None = None


def _claim(kind: str) -> None:
    """Fix this process's kind of launch at its first launch; a launch of the other kind is a clear error."""
    global _launch_kind
    if _launch_kind == kind:
        return
    if _launch_kind is not None:
        tensors = "CUDA" if kind == "compiled" else "CPU"
        raise KernelBackendError(f"this process already launched Triton kernels {_launch_kind}; {kind} launches "
                                 f"({tensors} tensors) must run in a process of their own (interpreted: with "
                                 f"TRITON_INTERPRET=1)")
    if kind == "compiled" and stdlib_interpreted():
        raise KernelBackendError("triton was imported with TRITON_INTERPRET set, so this process cannot launch "
                                 "compiled kernels: unset TRITON_INTERPRET for processes that use CUDA tensors")
    _launch_kind = kind


@functools.lru_cache(maxsize=None)
def _interpreter_index_is_strict() -> bool:
    """The installed interpreter turns a scalar into a Python int with `int(data)`, which numpy >= 2.4 refuses
    for the 1-element arrays the interpreter keeps scalars in (triton 3.6; 3.9 squeezes first). Kernels whose
    loop bounds are runtime values (`range(0, K, BLOCK_K)`) then fail with "only 0-dimensional arrays ...".
    Asked of the interpreter itself; False where its internals are not the ones this repair knows."""
    import types

    import numpy as np
    from triton.runtime import interpreter

    if not hasattr(interpreter, "_LangPatchScope") or not hasattr(interpreter, "_patch_lang_tensor"):
        return False
    tensor = language().tensor
    scope = interpreter._LangPatchScope()
    interpreter._patch_lang_tensor(tensor, scope)
    try:
        tensor.__index__(types.SimpleNamespace(handle=types.SimpleNamespace(data=np.ones(1, np.int32))))
    except TypeError:
        return True
    finally:
        scope.restore()
    return False


@contextlib.contextmanager
def _interpreter_compat():
    """Two repairs to Triton's interpreter, for the duration of one CPU launch.

    - Triton fixes interpret-vs-compile for its standard library when `triton` is first imported (from
      TRITON_INTERPRET). If that happened without the variable, nested calls to those helpers fail under the
      interpreter; we route them through the interpreter instead. A no-op when the variable was set in time.
    - Where the interpreter's scalar-to-index conversion is too strict for numpy (see
      `_interpreter_index_is_strict`), loop bounds squeeze the 1-element array first, as newer Triton does.
    Either patch is active only in a process that runs kernels interpreted (`_claim`).
    """
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    with contextlib.ExitStack() as undo:
        if not stdlib_interpreted():
            original_call = JITFunction.__call__
            JITFunction.__call__ = lambda self, *args, **kwargs: _interpreted(self.fn)(*args, **kwargs)
            undo.callback(setattr, JITFunction, "__call__", original_call)
        if _interpreter_index_is_strict():
            original_patch = interpreter._patch_lang_tensor

            def patch_lang_tensor(tensor, scope):
                original_patch(tensor, scope)
                scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

            interpreter._patch_lang_tensor = patch_lang_tensor
            undo.callback(setattr, interpreter, "_patch_lang_tensor", original_patch)
        yield


# While set (`recording`), a launch calls this with (kernel function, grid, args, kwargs) instead of running.
_recorder = None


@contextlib.contextmanager
def recording(record):
    """Launches call `record(fn, grid, args, kwargs)` instead of running (the compile check: `compile_check`);
    `fn` is the kernel's Python function. Not reentrant."""
    global _recorder
    if _recorder is not None:
        raise RuntimeError("launches are already being recorded")
    _recorder = record
    try:
        yield
    finally:
        _recorder = None


class _Launcher:
    """`kernel[grid](*args)` in the form that runs on `device`."""

    def __init__(self, kernel, device: torch.device):
        from triton.runtime.interpreter import InterpretedFunction

        if isinstance(kernel, LazyKernel):
            kernel = kernel.materialize()
        self.on_cpu = device.type == "cpu"
        interpreted = isinstance(kernel, InterpretedFunction)
        if self.on_cpu:
            self.kernel = kernel if interpreted else _interpreted(kernel.fn)
        else:
            self.kernel = _compiled(kernel.fn) if interpreted else kernel

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            if _recorder is not None:
                return _recorder(self.kernel.fn, grid, args, kwargs)
            if not self.on_cpu:
                _claim("compiled")
                return self.kernel[grid](*args, **kwargs)
            _claim("interpreted")
            with _interpreter_compat():
                return self.kernel[grid](*args, **kwargs)

        return run


def launchable(kernel, device: torch.device) -> _Launcher:
    """The kernel in the form that runs on `device`: interpreted on CPU, compiled elsewhere."""
    return _Launcher(kernel, device)


def cdiv(a: int, b: int) -> int:
    """Ceiling division, for grid sizes."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton block sizes must be powers of two)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def check(cond: bool, message: str) -> None:
    """Shape/dtype guard for launchers: a ValueError that says what was expected."""
    if not cond:
        raise ValueError(message)
