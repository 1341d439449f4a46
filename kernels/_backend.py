"""Op-level dispatch shared by every op (`backend=None|"triton"|"torch"`; None: Triton for CUDA tensors,
the torch twin otherwise) and the Triton launch plumbing. Which kernels a model runs is decided once by
its `Backend` (`backend.py`), which always passes the op backend explicitly.

Triton is imported here, guarded, so that a machine without it can still import every kernel
module (the kernels are then plain Python functions that nobody launches). The choice of
interpreter vs compiler is made per launch from the tensors' device, not from the process
environment at import time: a CPU tensor can only run under Triton's interpreter, a CUDA
tensor only compiled. That keeps tests correct whatever order modules were imported in.
"""
from __future__ import annotations

import contextlib
import functools

import torch

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None

    class _NoTriton:
        """Stands in for `triton.language` so kernel signatures still evaluate."""

        def __getattr__(self, name):
            return None

    tl = _NoTriton()

    def jit(fn):
        return fn


OP_BACKENDS = ("triton", "torch")


class KernelBackendError(RuntimeError):
    """A backend was asked for that cannot run here (say, triton without triton installed)."""


def pick_backend(x: torch.Tensor, backend: str | None) -> str:
    """`backend` if given, else "triton" for CUDA tensors (when triton imports) and "torch" otherwise."""
    if backend is None:
        return "triton" if x.is_cuda and triton is not None else "torch"
    if backend not in OP_BACKENDS:
        raise KernelBackendError(f"unknown kernel backend {backend!r}; use one of {OP_BACKENDS} or None")
    if backend == "triton" and triton is None:
        raise KernelBackendError("backend='triton' needs the triton package: pip install triton")
    return backend


@functools.lru_cache(maxsize=None)
def _interpreted(fn):
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    return triton.runtime.jit.JITFunction(fn)


@contextlib.contextmanager
def _interpretable_stdlib():
    """Let interpreted kernels call triton's own @jit helpers (tl.zeros, tl.max, ...).

    Triton fixes interpret-vs-compile for its standard library when `triton` is first
    imported (from TRITON_INTERPRET). If that happened without the variable, nested calls
    to those helpers fail under the interpreter; for the duration of a CPU launch we route
    them through the interpreter instead. A no-op when the variable was set in time.
    """
    from triton.runtime.jit import JITFunction

    if not isinstance(tl.zeros, JITFunction):
        yield
        return
    original = JITFunction.__call__
    JITFunction.__call__ = lambda self, *args, **kwargs: _interpreted(self.fn)(*args, **kwargs)
    try:
        yield
    finally:
        JITFunction.__call__ = original


class _Launcher:
    """`kernel[grid](*args)` in the form that runs on `device`."""

    def __init__(self, kernel, device: torch.device):
        from triton.runtime.interpreter import InterpretedFunction

        self.on_cpu = device.type == "cpu"
        interpreted = isinstance(kernel, InterpretedFunction)
        if self.on_cpu:
            self.kernel = kernel if interpreted else _interpreted(kernel.fn)
        else:
            self.kernel = _compiled(kernel.fn) if interpreted else kernel

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            if not self.on_cpu:
                return self.kernel[grid](*args, **kwargs)
            with _interpretable_stdlib():
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
