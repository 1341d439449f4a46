"""Built-in data sets (shared, read-only) and how to find them."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import DataError

BUILTIN_TEXTS = {
    "wikitext2": "wikitext-2-raw/wiki.test.raw",
    "wikitext2-valid": "wikitext-2-raw/wiki.valid.raw",
}
BUILTIN_FILES = {"sharegpt": "sharegpt/ShareGPT_V3_filtered_500.json"}
_REPO_ROOT = Path(__file__).resolve().parents[1]


def data_dirs() -> list[Path]:
    """Where the shared data may live: $LLMOPT_DATA_DIR, then ../shared/data beside the repo or cwd."""
    dirs = []
    if os.environ.get("LLMOPT_DATA_DIR"):
        dirs.append(Path(os.environ["LLMOPT_DATA_DIR"]))
    dirs += [_REPO_ROOT.parent / "shared" / "data", Path.cwd().parent / "shared" / "data",
             Path.cwd() / "shared" / "data"]
    return dirs


def _builtin(name: str, rel: str) -> Path:
    for d in data_dirs():
        if (d / rel).is_file():
            return d / rel
    raise DataError(f"built-in data set '{name}' needs {rel}; not found under "
                    f"{', '.join(str(d) for d in data_dirs()[:2])} (set LLMOPT_DATA_DIR to the folder holding it)")


def resolve_text(name_or_path: str) -> Path:
    """A built-in text name (wikitext2, wikitext2-valid) or a path to a UTF-8 text file."""
    if name_or_path in BUILTIN_TEXTS:
        return _builtin(name_or_path, BUILTIN_TEXTS[name_or_path])
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        known = ", ".join(BUILTIN_TEXTS)
        raise DataError(f"{name_or_path}: no such text file and not a built-in name ({known})")
    return path


def resolve_file(name_or_path: str) -> Path:
    if name_or_path in BUILTIN_FILES:
        return _builtin(name_or_path, BUILTIN_FILES[name_or_path])
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise DataError(f"{name_or_path}: no such file")
    return path
