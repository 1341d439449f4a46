"""String metadata of the GGUF a lineage started from (`source.path` of an alias or .gguf source): the model's
own `tokenizer.ggml.pre` and `general.*` facts, which a Hugging Face import does not keep.

Read by hand, not with gguf's GGUFReader, which parses every array element into Python objects (seconds for a
49k-token vocabulary): this skips arrays by their sizes and stops once it has what it was asked for.
"""
from __future__ import annotations

import struct
from pathlib import Path

_SCALARS = {0: 1, 1: 1, 7: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
STRING, ARRAY = 8, 9


def source_strings(source: dict, keys: tuple[str, ...]) -> dict[str, str]:
    """The string values of `keys` in the lineage's source GGUF, if it is still there and of the size recorded;
    {} otherwise (a Hugging Face source, a moved or changed file, a file that does not parse)."""
    path = Path(source.get("path") or "")
    if source.get("kind") not in ("alias", "gguf") or not path.is_file():
        return {}
    if source.get("bytes") is not None and path.stat().st_size != source["bytes"]:
        return {}
    try:
        return gguf_strings(path, keys)
    except (OSError, ValueError, UnicodeDecodeError, struct.error):
        return {}


def gguf_strings(path: Path, keys: tuple[str, ...]) -> dict[str, str]:
    """The string values of those of `keys` that a GGUF file's metadata has."""
    found: dict[str, str] = {}
    with open(path, "rb") as f:
        magic, version = f.read(4), struct.unpack("<I", f.read(4))[0]
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path}: not a GGUF v2/v3 file")
        _, count = struct.unpack("<QQ", f.read(16))
        for _ in range(count):
            key, vtype = _string(f), struct.unpack("<I", f.read(4))[0]
            if vtype == STRING and key in keys:
                found[key] = _string(f)
                if len(found) == len(keys):
                    break
            else:
                _skip(f, vtype)
    return found


def _string(f) -> str:
    n = struct.unpack("<Q", f.read(8))[0]
    return f.read(n).decode("utf-8")


def _skip(f, vtype: int) -> None:
    if vtype == STRING:
        f.seek(struct.unpack("<Q", f.read(8))[0], 1)
    elif vtype == ARRAY:
        item, n = struct.unpack("<IQ", f.read(12))
        if item in _SCALARS:
            f.seek(n * _SCALARS[item], 1)
        else:
            for _ in range(n):
                _skip(f, item)
    elif vtype in _SCALARS:
        f.seek(_SCALARS[vtype], 1)
    else:
        raise ValueError(f"unknown GGUF value type {vtype}")
