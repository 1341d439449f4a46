"""Safetensors reading by mmap (no copy) and sharded writing.

Reading maps the file copy-on-write and views tensors straight into the mapping, so loading a
model costs page-cache reads only: the weights are never held twice in memory. Every file name
(given, or read from an index's weight_map) is checked to stay inside its directory (`member_path`).
Writing splits the weights into files of up to `SHARD_BYTES` (2 GiB) each.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

import torch

from .artifact import SHARD_BYTES, member_path
from .errors import ArtifactError

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024


def read_header(path: Path) -> tuple[dict, int]:
    """Return (tensor entries, byte offset where data starts); errors name the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ArtifactError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, _MAX_HEADER):
            raise ArtifactError(f"{path}: corrupted safetensors header (length {n} > file size)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ArtifactError(f"{path}: corrupted safetensors header ({e.__class__.__name__})") from None
    header.pop("__metadata__", None)
    data_len = max((e["data_offsets"][1] for e in header.values()), default=0)
    if 8 + n + data_len > size:
        raise ArtifactError(f"{path}: truncated safetensors file ({size} bytes, header needs {8 + n + data_len})")
    return header, 8 + n


def tensor_infos(path: Path) -> dict[str, tuple[str, list[int], int]]:
    """name -> (dtype name, shape, bytes), read from the header alone."""
    header, _ = read_header(path)
    return {k: (e["dtype"], e["shape"], e["data_offsets"][1] - e["data_offsets"][0]) for k, e in header.items()}


def load_mmap(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of one file, as views into a private (copy-on-write) memory map."""
    header, start = read_header(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    buf = torch.frombuffer(mm, dtype=torch.uint8) if len(mm) else torch.empty(0, dtype=torch.uint8)
    out = {}
    for name, e in header.items():
        if e["dtype"] not in _DTYPES:
            raise ArtifactError(f"{path}: tensor {name} has unsupported dtype {e['dtype']}")
        lo, hi = e["data_offsets"]
        dtype = _DTYPES[e["dtype"]]
        out[name] = _view(buf[start + lo:start + hi], dtype, e["shape"])
    return out


def _view(raw: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    try:
        return raw.view(dtype).reshape(shape)
    except RuntimeError:  # misaligned offset (foreign writer): one copy of this tensor only
        return raw.clone().view(dtype).reshape(shape)


def load_dir(directory: Path, files: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of `files` (names relative to `directory`, each refused if it leads outside it)."""
    state = {}
    for name in files:
        state.update(load_mmap(member_path(directory, name, f"{directory}: weight file")))
    return state


def weight_files(directory: Path) -> list[str]:
    """The safetensors files of a model directory, via the index when there is one; an index entry that
    leads outside the directory is refused, naming the entry."""
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ArtifactError(f"{index}: malformed index ({e.__class__.__name__}: {e})") from None
        if not isinstance(weight_map, dict):
            raise ArtifactError(f"{index}: malformed index (weight_map is not a mapping)")
        for tensor, name in sorted(weight_map.items()):
            member_path(directory, name, f"{index} weight_map[{tensor!r}]")
        return sorted(set(weight_map.values()))
    return sorted(p.name for p in directory.glob("*.safetensors"))


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes `state` takes as safetensors data (tensors that alias another counted once)."""
    return sum(t.numel() * t.element_size() for t in _dedup_shared(state).values())


def _dedup_shared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop tensors that alias an earlier one (tied embeddings); loading re-ties them."""
    seen, out = set(), {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype) if t.numel() else None
        if key is not None and key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def _plan_shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    shards, current, size = [], [], 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def save_state_dict(state: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write `state` as model.safetensors, or numbered shards plus an index above the limit."""
    from safetensors.torch import save_file

    state = {k: v.detach().to("cpu").contiguous() for k, v in _dedup_shared(state).items()}
    shards = _plan_shards(state, max_shard_bytes)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, keys in zip(names, shards):
        save_file({k: state[k] for k in keys}, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    if len(names) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return names


class ShardWriter:
    """Writes a state dict piece by piece (a quantized layer at a time) into files of up to `max_bytes`.

    Pieces wait in memory until the next one would pass the limit, then go out as one file, so the
    output holds as few files as `save_state_dict` writes (one below 2 GiB) while a stage never holds
    more than one file's worth of its output. `close` writes the rest and names the files
    model-0000i-of-0000n plus the index (or a single model.safetensors)."""

    def __init__(self, directory: Path, max_bytes: int = SHARD_BYTES):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.parts: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors:
            return
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in _dedup_shared(tensors).items()}
        clash = set(tensors) & (set(self.weight_map) | set(self.pending))
        if clash:
            raise ValueError(f"tensor written twice: {sorted(clash)[0]}")
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending.update(tensors)
        self.pending_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        tensors = self.pending  # each piece was deduplicated as it came in
        name = f"part-{len(self.parts):05d}.safetensors"
        save_file(tensors, str(self.directory / name), metadata={"format": "pt"})
        self.parts.append(name)
        self.weight_map.update({k: name for k in tensors})
        self.total += sum(t.numel() * t.element_size() for t in tensors.values())
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        if self.pending:
            self._flush()
        n = len(self.parts)
        final = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        renames = dict(zip(self.parts, final))
        for old, new in renames.items():
            os.replace(self.directory / old, self.directory / new)
        if n > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {k: renames[v] for k, v in sorted(self.weight_map.items())}}
            (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2))
        return final
