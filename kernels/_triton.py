"""Triton, imported at a kernel's first use instead of with the kernel modules.

Every Triton kernel module imports `jit`, `tl` and `constexpr` from here (through `_backend`). None of them
imports triton: `jit(fn)` only wraps `fn` in a `LazyKernel`, `tl` stands in for `triton.language` (the kernels'
annotations are strings: `from __future__ import annotations`), and a `constexpr` is an int. A process that never
launches a Triton kernel (`llmopt serve` on CPU) never imports triton, about a tenth of a second of its start-up.

The first launch (`_backend.launchable`), or a caller asking for the Triton kernel (`LazyKernel.materialize`),
imports triton and rewrites the globals of the kernel's module (`materialize`): `tl` becomes `triton.language`
itself (the interpreter finds it there by identity), each `constexpr` a `tl.constexpr`, and each `LazyKernel` its
Triton kernel, so that the compiler and the interpreter, which resolve names through the kernel's
`fn.__globals__`, see what a plain `@triton.jit` module holds. A helper kernel imported from another module is
the same `LazyKernel` object there, so both modules get the same Triton kernel, and its own module is rewritten
too. On a machine without triton nothing is ever rewritten and nothing launches (`_backend.pick_backend`).
"""
from __future__ import annotations

import functools
import importlib.util
import threading


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the triton package is installed (found, not imported)."""
    return importlib.util.find_spec("triton") is not None


def language():
    """`triton.language` (imports triton)."""
    import triton.language

    return triton.language


class _Language:
    """`tl` until the module's kernels are materialized. Kernel modules read nothing of it at import; an attribute
    read anyway is the real one (importing triton), or None without triton, where nothing launches."""

    def __getattr__(self, name):
        return getattr(language(), name) if available() else None

    def __repr__(self):
        return "<triton.language, imported at the first launch>"


tl = _Language()


class constexpr(int):
    """A module-level constant that kernels read (Triton allows only `tl.constexpr` globals): an int to Python
    code, a `tl.constexpr` in the module's globals once its kernels are materialized."""


def stdlib_interpreted() -> bool:
    """Triton was imported with TRITON_INTERPRET set: its own @jit helpers (tl.zeros, tl.max, ...) are then
    interpreter functions, and this process cannot compile kernels that call them."""
    from triton.runtime.jit import JITFunction

    return not isinstance(language().zeros, JITFunction)


def _triton_jit(fn):
    """`triton.jit(fn)` of the same kind as Triton's standard library (fixed when triton was imported), whatever
    TRITON_INTERPRET says now: the kernels and the helpers they call are then interpreted, or compiled, together."""
    if stdlib_interpreted():
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    from triton.runtime.jit import JITFunction

    return JITFunction(fn)


_LOCK = threading.RLock()  # materializing: one thread at a time, reentrant for helpers in other modules
_materialized: set[int] = set()  # ids of the module globals rewritten (modules live as long as the process)


class LazyKernel:
    """A kernel function as `@jit` leaves it: `fn`, its name and module; the Triton kernel on `materialize()`."""

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)
        self._kernel = None  # the Triton kernel, once built
        self._ready = False  # built and every module it reaches rewritten

    def materialize(self):
        """The Triton kernel (`JITFunction`, or `InterpretedFunction` where triton runs interpreted): imports triton
        and rewrites the globals of the modules it reaches, once (see the module docstring)."""
        if not self._ready:
            with _LOCK:
                self._build()
            self._ready = True
        return self._kernel

    def _build(self):
        if self._kernel is None:
            self._kernel = _triton_jit(self.fn)
            materialize(self.fn.__globals__)
        return self._kernel

    def __repr__(self):
        return f"<kernel {self.__module__}.{self.__qualname__}, not yet given to triton>"


def jit(fn) -> LazyKernel:
    """`@triton.jit`, deferred: the kernel is built at its first launch (`LazyKernel.materialize`)."""
    return LazyKernel(fn)


def materialize(namespace: dict) -> None:
    """Rewrite a kernel module's globals as `@triton.jit` and `import triton.language as tl` would have left them:
    `tl`, every `constexpr` and every `LazyKernel` (helpers from other modules included). Once per module."""
    with _LOCK:
        if id(namespace) in _materialized:
            return
        _materialized.add(id(namespace))
        real = language()
        for name, value in list(namespace.items()):
            if value is tl:
                namespace[name] = real
            elif isinstance(value, constexpr):
                namespace[name] = real.constexpr(int(value))
            elif isinstance(value, LazyKernel):
                namespace[name] = value._build()
