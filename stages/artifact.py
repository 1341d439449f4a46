"""The llmopt artifact: a model directory plus `llmopt.json`, written atomically, verified on load.

Layout: HF `config.json`, tokenizer and generation config; safetensors weights; `llmopt.json` with the
format version, the stage and its config, parent (path + content hash), lineage back to the source,
sha256 and size of every file, model facts and metrics. The content hash covers every file but the
manifest, so storing a new metric (an eval) does not change an artifact's identity.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from .errors import ArtifactError

MANIFEST = "llmopt.json"
FORMAT = "llmopt-artifact"
FORMAT_VERSION = 1
TMP_PREFIX = ".llmopt-tmp-"
_REQUIRED = ("format", "format_version", "stage", "config", "files", "content_hash", "lineage")


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llmopt")
    except PackageNotFoundError:
        return "0+unknown"


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def content_hash(files: dict[str, dict]) -> str:
    listing = "".join(f"{name}\0{files[name]['sha256']}\n" for name in sorted(files))
    return hashlib.sha256(listing.encode()).hexdigest()


def safetensors_bytes(directory: Path) -> int:
    """Bytes of the safetensors files directly in `directory`: a model's weights on disk."""
    return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))


def is_artifact(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


@dataclass
class Artifact:
    """An artifact on disk with its parsed manifest."""

    path: Path
    manifest: dict

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> "Artifact":
        path = Path(path)
        if not path.is_dir():
            raise ArtifactError(f"{path}: no such artifact directory")
        art = cls(path, _read_manifest(path / MANIFEST))
        if verify:
            art.verify()
        return art

    @property
    def content_hash(self) -> str:
        return self.manifest["content_hash"]

    @property
    def stage(self) -> str:
        return self.manifest["stage"]

    @property
    def weight_files(self) -> list[str]:
        """The model's safetensors files (a sharded artifact keeps its ranks' files in rank-NN/ folders)."""
        return sorted(n for n in self.manifest["files"] if n.endswith(".safetensors") and "/" not in n)

    @property
    def tensor_parallel(self) -> dict | None:
        """The split plan of a sharded artifact (`llmopt shard`), None for a whole model."""
        return self.manifest.get("model", {}).get("tensor_parallel")

    def rank_files(self, rank: int) -> list[str]:
        """Rank `rank`'s safetensors files, relative to the artifact directory."""
        prefix = f"{rank_dir(rank)}/"
        return sorted(n for n in self.manifest["files"] if n.startswith(prefix) and n.endswith(".safetensors"))

    def verify(self) -> None:
        """Check every listed file's size and sha256; the error names the first bad file."""
        for name, entry in sorted(self.manifest["files"].items()):
            f = self.path / name
            if not f.is_file():
                raise ArtifactError(f"{f}: file listed in {MANIFEST} is missing")
            size = f.stat().st_size
            if size != entry["bytes"]:
                raise ArtifactError(f"{f}: size {size} bytes, manifest says {entry['bytes']} (truncated or replaced)")
            if sha256_file(f) != entry["sha256"]:
                raise ArtifactError(f"{f}: sha256 does not match {MANIFEST} (file was modified or corrupted)")

    def update_metrics(self, key: str, value) -> None:
        """Store one metric in the manifest (atomic rewrite; the content hash is unchanged)."""
        self.manifest.setdefault("metrics", {})[key] = value
        _write_json_atomic(self.path / MANIFEST, self.manifest)

    def lineage_entry(self) -> dict:
        return {"stage": self.stage, "path": str(self.path.resolve()), "content_hash": self.content_hash,
                "config": self.manifest["config"], "created_at": self.manifest.get("created_at")}


def rank_dir(rank: int) -> str:
    """The folder of one rank's weights inside a sharded artifact."""
    return f"rank-{rank:02d}"


def _read_manifest(path: Path) -> dict:
    if not path.is_file():
        raise ArtifactError(f"{path.parent}: not an llmopt artifact (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: corrupted manifest ({e.__class__.__name__}: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not an llmopt manifest (format field missing or wrong)")
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise ArtifactError(f"{path}: manifest lacks {', '.join(missing)}")
    if manifest["format_version"] > FORMAT_VERSION:
        raise ArtifactError(f"{path}: format version {manifest['format_version']} is newer than this llmopt "
                            f"understands ({FORMAT_VERSION}); upgrade llmopt")
    return manifest


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ArtifactWriter:
    """Write an artifact into a temporary sibling; `commit` renames it into place.

    Leaving the block without a commit (an error, Ctrl-C) removes the temporary directory, so an
    interrupted stage never leaves a partial artifact at the destination.
    """

    def __init__(self, dest: str | Path, force: bool = False):
        self.dest = Path(dest)
        self.force = force
        self.tmp = self.dest.parent / f"{TMP_PREFIX}{self.dest.name}-{uuid.uuid4().hex[:8]}"
        self.committed: Artifact | None = None

    def __enter__(self) -> "ArtifactWriter":
        check_destination(self.dest, self.force)
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.committed is None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def commit(self, stage: str, config: dict, parent: Artifact | None, source: dict,
               model: dict | None = None, metrics: dict | None = None) -> Artifact:
        from .safetensors_io import fsync_tree

        files = {p.relative_to(self.tmp).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                 for p in sorted(self.tmp.rglob("*")) if p.is_file() and p != self.tmp / MANIFEST}
        chash = content_hash(files)
        entry = {"stage": stage, "path": str(self.dest.resolve()), "content_hash": chash,
                 "config": config, "created_at": now_iso()}
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "tool_version": tool_version(),
            "created_at": entry["created_at"], "stage": stage, "config": config, "source": source,
            "parent": None if parent is None else {"path": str(parent.path.resolve()),
                                                   "content_hash": parent.content_hash},
            "lineage": (parent.manifest["lineage"] if parent else []) + [entry],
            "files": files, "content_hash": chash, "model": model or {}, "metrics": metrics or {},
        }
        _write_json_atomic(self.tmp / MANIFEST, manifest)
        fsync_tree(self.tmp)
        self._swap_into_place()
        self.committed = Artifact(self.dest, manifest)
        return self.committed

    def _swap_into_place(self) -> None:
        old = None
        if self.dest.exists():
            old = self.dest.parent / f"{TMP_PREFIX}{self.dest.name}-old-{uuid.uuid4().hex[:8]}"
            os.replace(self.dest, old)
        os.replace(self.tmp, self.dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def check_destination(dest: Path, force: bool) -> None:
    """Refuse to clobber: an existing artifact needs --force; anything else is never overwritten."""
    dest = Path(dest)
    if not dest.exists():
        return
    if not force:
        raise ArtifactError(f"{dest} already exists; choose another -o or pass --force to replace it")
    if dest.is_dir() and (is_artifact(dest) or not any(dest.iterdir())):
        return
    raise ArtifactError(f"{dest} exists and is not an llmopt artifact; refusing to replace it even with --force")
