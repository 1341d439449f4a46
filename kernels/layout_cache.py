"""The layout cache: a model's kernel layouts (tiled GEMV weights, torch's packed int4/int8 weights, ...),
built once and read back by mmap at the next start instead of being rebuilt (seconds for SmolLM2).

One file per model and build: `cache_dir()/layouts/<key>.bin` (`cpu_native.cache_dir()`, default
`~/.cache/llmopt`). The key hashes what the layouts depend on: the caller's identity of the weights (an
artifact's content hash), the backend and dtype, torch's version, `VERSION` and the source of the kernel
modules that build layouts, so any change to them makes a new entry rather than reusing a stale one.

How it is used: the loader opens a `LayoutCache`, runs each projection's construction under
`cache.scope(name)`, and the kernels wrap each expensive layout in `cached_layout(kind, build)`: with a
scope active and the entry present, the stored object comes back (tensors viewing the mapped file);
otherwise `build()` runs and its result is kept for `save()`. Without a scope, `cached_layout` is `build()`.

Safety: the file is written to a temporary name and renamed (concurrent starts each write a whole file;
the last rename wins, and every version is complete). Its header holds the sha256 of its data, checked
the first time a file is met; a stamp beside it records the size, mtime and inode that were checked, so
later starts trust an unchanged file without reading it. A file that does not match its header, a
truncated file, or an entry whose object cannot be restored is rebuilt, never used. Only classes of
`llmopt.kernels` modules already imported are restored (nothing is imported or called from a file).
"""
from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import json
import mmap
import os
import struct
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, TypeVar

import torch

VERSION = 1
ALIGN = 64  # every tensor starts on a 64-byte boundary (AVX-512 loads)
MAGIC = b"LLMOPTLY"
_SOURCES = ("cpu_native.py", "cpu_backends.py", "cpu_linear.py", "cpu_quant.py", "wq_matmul.py", "linear.py",
            "layout_cache.py")
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                                     torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                                                     torch.bool)}
_SCOPE: contextvars.ContextVar = contextvars.ContextVar("llmopt_layout_scope", default=None)
T = TypeVar("T")


def layout_key(identity: str, backend: str, dtype) -> str:
    """The cache key of a model's layouts: `identity` (the weights' content hash, plus whatever else the caller's
    own transformation depends on), backend and dtype, torch and this code."""
    h = hashlib.sha256()
    for part in (identity, backend, str(dtype), torch.__version__, str(VERSION)):
        h.update(part.encode() + b"\0")
    here = Path(__file__).parent
    for name in _SOURCES:
        path = here / name
        h.update(path.read_bytes() if path.exists() else b"-")
    return h.hexdigest()[:32]


def cached_layout(kind: str, build: Callable[[], T], keep: dict | None = None) -> T:
    """`build()`, or its result stored under the active scope's name + `kind`. `keep`: tensors the result may
    hold that the caller owns (the layer's own weights): stored as references to these, not as copies."""
    active = _SCOPE.get()
    if active is None:
        return build()
    cache, name = active
    return cache.layout(f"{name}/{kind}", build, keep or {})


class LayoutCache:
    """The stored layouts of one model under `key` in `folder`; `status` says what `open` found."""

    def __init__(self, folder: Path, key: str):
        self.folder, self.key = Path(folder), key
        self.path = self.folder / f"{key}.bin"
        self.entries: dict[str, tuple] = {}  # name -> (the object to store, the caller's tensors it may hold)
        self.stored: dict[str, dict] = {}  # name -> its description in the file read
        self.hits = self.misses = 0
        self.status = "miss"
        self._data: torch.Tensor | None = None

    @classmethod
    def open(cls, folder: Path, key: str) -> "LayoutCache":
        """The cache for `key`, with the file's entries when it is there and sound (else they are rebuilt)."""
        cache = cls(folder, key)
        try:
            cache._read()
        except FileNotFoundError:
            cache.status = "miss"
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            cache.stored, cache._data = {}, None
            cache.status = f"rebuilt ({e})"
        return cache

    @contextmanager
    def scope(self, name: str):
        """`cached_layout` calls inside the block store and find their layouts under `name`."""
        token = _SCOPE.set((self, name))
        try:
            yield self
        finally:
            _SCOPE.reset(token)

    def layout(self, name: str, build: Callable[[], T], keep: dict) -> T:
        if self.stored.get(name) == {"unstorable": True}:
            obj = build()
            self.entries[name] = (obj, keep)
            return obj
        if name in self.stored:
            try:
                obj = _restore(self.stored[name], self._data, keep)
                self.hits += 1
                self.entries[name] = (obj, keep)
                return obj
            except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
                self.status = f"rebuilt ({name}: {e})"
        obj = build()
        self.misses += 1
        self.entries[name] = (obj, keep)
        return obj

    def describe(self) -> str:
        """'hit (121 layouts)', 'miss (121 built)' or 'rebuilt (...)': for the start-up line."""
        if self.misses == 0 and self.hits:
            return f"hit ({self.hits} layouts)"
        if self.status.startswith("rebuilt"):
            return f"{self.status}; {self.misses} built"
        return f"miss ({self.misses} built)" if not self.hits else f"partial ({self.hits} read, {self.misses} built)"

    def save(self) -> bool:
        """Write the file when anything was built (atomically); False when nothing needed writing or the
        folder is not writable (the layouts then stay unstored, and are rebuilt next time)."""
        if self.misses == 0:
            return False
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            blobs: list[bytes | torch.Tensor] = []
            entries, size = {}, 0
            for name, (obj, keep) in self.entries.items():
                mark = len(blobs)
                try:
                    entries[name], size = _describe(obj, keep, blobs, offset=size)
                except TypeError:  # a layout holding what cannot be stored: built at every start, not a miss
                    entries[name] = {"unstorable": True}
                    del blobs[mark:]
                    size = sum(len(b) if isinstance(b, bytes) else b.numel() * b.element_size() for b in blobs)
            _write_atomic(self.path, self.key, entries, blobs, size)
        except OSError as e:  # a read-only or full disk: serve anyway
            self.status = f"not saved ({e.__class__.__name__}: {e})"
            return False
        return True

    def _read(self) -> None:
        with open(self.path, "rb") as f:
            head = f.read(16)
            if len(head) < 16 or head[:8] != MAGIC:
                raise ValueError("not a layout file")
            (n,) = struct.unpack("<Q", head[8:])
            st = os.fstat(f.fileno())
            if n > st.st_size:
                raise ValueError("truncated (header)")
            header = json.loads(f.read(n))
            start = 16 + n
            if header.get("key") != self.key or header.get("version") != VERSION:
                raise ValueError("written for another key")
            if st.st_size != start + header["bytes"]:
                raise ValueError(f"truncated ({st.st_size} bytes, header says {start + header['bytes']})")
            if not self._stamped(st):
                if _sha256_from(f, start) != header["sha256"]:
                    raise ValueError("data does not match its checksum")
                self._stamp(st)
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: torch may write, the file stays
        self._data = torch.frombuffer(mapped, dtype=torch.uint8, offset=start, count=header["bytes"]) \
            if header["bytes"] else torch.empty(0, dtype=torch.uint8)
        self.stored = header["entries"]
        self.status = "hit"

    def _stamp_path(self) -> Path:
        return self.path.with_suffix(".ok")

    def _stamped(self, st: os.stat_result) -> bool:
        try:
            return json.loads(self._stamp_path().read_text()) == _identity(st)
        except (OSError, ValueError):
            return False

    def _stamp(self, st: os.stat_result) -> None:
        try:
            _write_text_atomic(self._stamp_path(), json.dumps(_identity(st)))
        except OSError:
            pass  # unstamped: the next start checks the data again


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _sha256_from(f, start: int) -> str:
    f.seek(start)
    h = hashlib.sha256()
    while block := f.read(8 << 20):
        h.update(block)
    return h.hexdigest()


# --- objects <-> descriptions ---------------------------------------------------------------------------
def _describe(obj, keep: dict, blobs: list, offset: int):
    """(JSON description of obj, bytes used so far); tensors are appended to `blobs` at aligned offsets,
    but those of `keep` are named instead."""
    if isinstance(obj, torch.Tensor):
        ref = next((k for k, v in keep.items() if v is obj), None)
        if ref is not None:
            return {"ref": ref}, offset
        if obj.device.type != "cpu" or obj.layout != torch.strided or str(obj.dtype).removeprefix("torch.") \
                not in _DTYPES:
            raise TypeError(f"cannot store a {obj.dtype} {obj.layout} tensor on {obj.device}")
        t = obj.detach().contiguous()
        pad = -offset % ALIGN
        if pad:
            blobs.append(bytes(pad))
        offset += pad
        blobs.append(t)
        nbytes = t.numel() * t.element_size()
        return {"tensor": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset,
                "nbytes": nbytes}, offset + nbytes
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}, offset
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).removeprefix("torch.")}, offset
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError("cannot store a dict with keys other than strings")
        items = {}
        for k, item in obj.items():
            items[k], offset = _describe(item, keep, blobs, offset)
        return {"dict": items}, offset
    if isinstance(obj, (tuple, list)):
        items = []
        for item in obj:
            d, offset = _describe(item, keep, blobs, offset)
            items.append(d)
        return {"tuple" if isinstance(obj, tuple) else "list": items}, offset
    cls = type(obj)
    if not cls.__module__.startswith("llmopt.kernels") or not hasattr(obj, "__dict__"):
        raise TypeError(f"cannot store a {cls.__module__}.{cls.__qualname__}")
    fields = {}
    for name, value in vars(obj).items():
        fields[name], offset = _describe(value, keep, blobs, offset)
    return {"object": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}, offset


def _restore(desc: dict, data: torch.Tensor, keep: dict):
    if "tensor" in desc:
        start, nbytes = int(desc["offset"]), int(desc["nbytes"])
        if start < 0 or start + nbytes > data.numel():
            raise ValueError("tensor outside the file")
        return data[start:start + nbytes].view(_DTYPES[desc["tensor"]]).view(desc["shape"])
    if "ref" in desc:
        return keep[desc["ref"]]
    if "value" in desc:
        return desc["value"]
    if "dtype" in desc:
        return _DTYPES[desc["dtype"]]
    if "dict" in desc:
        return {k: _restore(d, data, keep) for k, d in desc["dict"].items()}
    if "tuple" in desc or "list" in desc:
        items = [_restore(d, data, keep) for d in desc.get("tuple", desc.get("list"))]
        return tuple(items) if "tuple" in desc else items
    module, _, qualname = desc["object"].partition(":")
    if not module.startswith("llmopt.kernels") or module not in sys.modules:
        raise ValueError(f"class {desc['object']} is not one of the loaded kernels")
    cls = getattr(sys.modules[module], qualname)
    obj = cls.__new__(cls)
    values = {name: _restore(d, data, keep) for name, d in desc["fields"].items()}
    if dataclasses.is_dataclass(cls) and set(values) != {f.name for f in dataclasses.fields(cls)}:
        raise ValueError(f"{qualname}: stored fields differ from the class's")
    for name, value in values.items():
        object.__setattr__(obj, name, value)  # frozen dataclasses too
    return obj


def _write_atomic(path: Path, key: str, entries: dict, blobs: list, size: int) -> None:
    h = hashlib.sha256()
    chunks = [b if isinstance(b, bytes) else memoryview(b.reshape(-1).view(torch.uint8).numpy()) for b in blobs]
    for c in chunks:
        h.update(c)
    header = json.dumps({"key": key, "version": VERSION, "bytes": size, "sha256": h.hexdigest(),
                         "entries": entries}).encode()
    header += b" " * (-(16 + len(header)) % ALIGN)  # data starts aligned
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            for c in chunks:
                f.write(c)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
