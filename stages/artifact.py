"""The llmopt artifact: a model directory plus `llmopt.json`, written atomically, verified on load.

Layout: HF `config.json`, tokenizer and generation config; safetensors weights; `llmopt.json` with the
format version, the stage and its config, parent (path + content hash), lineage back to the source,
sha256 and size of every file, model facts and metrics. The content hash covers every file but the
manifest, so storing a new metric (an eval) does not change an artifact's identity.

Every file name read from a manifest or a safetensors index goes through `member_path`, which refuses a
name that leaves the directory (absolute, `..`, or a symlink pointing out), so a crafted artifact cannot
make llmopt read another file of the machine. Writes go through `ArtifactWriter` (temporary sibling with
an owner record, free-space check, umask modes; see tempdirs.py).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import ArtifactError
from .tempdirs import (OWNER, TMP_PREFIX, apply_umask, check_space, claim, disk_full_errno, disk_full_message,
                       fsync_tree, sweep_leftovers, tree_bytes)

MANIFEST = "llmopt.json"
FORMAT = "llmopt-artifact"
FORMAT_VERSION = 1
SHARD_BYTES = 2 << 30  # weights go to safetensors files of up to this many bytes each (one tensor may pass it)
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


def member_path(root: Path, name, listed_in: str) -> Path:
    """`root / name` for a file name read from a manifest or index (`listed_in` says which entry); ArtifactError
    when it is not a relative path that stays inside `root` once symlinks are followed.

    A Hugging Face hub snapshot (`.../snapshots/REV/`) links its files to `../../blobs/`: those stay allowed.
    """
    if not isinstance(name, str) or not name or "\0" in name:
        raise ArtifactError(f"{listed_in}: entry {name!r} is not a file name")
    pure = PurePosixPath(name)
    if pure.is_absolute() or os.path.isabs(name):
        raise ArtifactError(f"{listed_in}: entry {name!r} is an absolute path; files must lie inside {root}")
    if ".." in pure.parts:
        raise ArtifactError(f"{listed_in}: entry {name!r} climbs out with '..'; files must lie inside {root}")
    path = Path(root) / name
    real, base = path.resolve(), Path(root).resolve()
    allowed = [base] + ([base.parent.parent / "blobs"] if base.parent.name == "snapshots" else [])
    if not any(real == a or a in real.parents for a in allowed):
        raise ArtifactError(f"{listed_in}: entry {name!r} is a symlink to {real}, outside {root}; "
                            "refusing to read it")
    return path


@dataclass
class Artifact:
    """An artifact on disk with its parsed manifest."""

    path: Path
    manifest: dict

    @classmethod
    def open(cls, path: str | Path, verify: bool = True, full: bool = False) -> "Artifact":
        """The artifact at `path`, its files checked (`verify`; `full`: hash them even if checked before)."""
        path = Path(path)
        if not path.is_dir():
            raise ArtifactError(f"{path}: no such artifact directory")
        art = cls(path, _read_manifest(path / MANIFEST))
        for name in art.manifest["files"]:  # even unverified: no entry may point outside the directory
            member_path(path, name, f"{path / MANIFEST} files")
        if verify:
            art.verify(full)
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

    @property
    def pipeline_parallel(self) -> dict | None:
        """The stage plan of an artifact sharded with `llmopt shard --pp`, None otherwise."""
        return self.manifest.get("model", {}).get("pipeline_parallel")

    @property
    def world_size(self) -> int:
        """How many rank processes serve it: stages times tensor-parallel ranks (1 for a whole model)."""
        if self.pipeline_parallel:
            return self.pipeline_parallel["world_size"]
        return self.tensor_parallel["tp"] if self.tensor_parallel else 1

    @property
    def sharding(self) -> str | None:
        """How a sharded artifact is split, as messages say it ("tensor parallelism (tp=2)", "pipeline
        parallelism (pp=2, tp=1)"); None for a whole model."""
        if self.pipeline_parallel:
            return f"pipeline parallelism (pp={self.pipeline_parallel['pp']}, tp={self.pipeline_parallel['tp']})"
        return f"tensor parallelism (tp={self.tensor_parallel['tp']})" if self.tensor_parallel else None

    def rank_files(self, rank: int) -> list[str]:
        """Rank `rank`'s safetensors files, relative to the artifact directory."""
        prefix = f"{rank_dir(rank)}/"
        return sorted(n for n in self.manifest["files"] if n.startswith(prefix) and n.endswith(".safetensors"))

    def verify(self, full: bool = False) -> None:
        """Check every listed file's size and sha256; the error names the first bad file.

        The sha256s are read once: a full check leaves a record (each file's size, mtime and inode, in
        `$LLMOPT_CACHE_DIR/verified`), and later checks of files whose size, mtime and inode all still match
        it skip the hashing, as make and Python's bytecode cache trust a file's stat. `full=True` (`llmopt
        inspect --verify`) always hashes everything."""
        stats = {}
        for name, entry in sorted(self.manifest["files"].items()):
            f = self.path / name
            if not f.is_file():
                raise ArtifactError(f"{f}: file listed in {MANIFEST} is missing")
            st = f.stat()
            if st.st_size != entry["bytes"]:
                raise ArtifactError(f"{f}: size {st.st_size} bytes, manifest says {entry['bytes']} (truncated or "
                                    "replaced)")
            stats[name] = [st.st_size, st.st_mtime_ns, st.st_ino, entry["sha256"]]
        record = _verified_record(self.path, self.content_hash)
        if not full and _read_json(record) == stats:
            return
        for name, entry in sorted(self.manifest["files"].items()):
            if sha256_file(self.path / name) != entry["sha256"]:
                raise ArtifactError(f"{self.path / name}: sha256 does not match {MANIFEST} (file was modified or "
                                    "corrupted)")
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            _write_json_atomic(record, stats)
        except (OSError, ArtifactError):
            pass  # no record: the next open hashes again

    def update_metrics(self, key: str, value) -> None:
        """Store one metric in the manifest (atomic rewrite; the content hash is unchanged). Under the folder's lock
        the key goes into the manifest as it is on disk now, so metrics that other processes stored since this one
        opened the artifact are kept (two `llmopt eval` runs on one artifact, each storing its text's result)."""
        with locked(self.path):
            on_disk = _read_json(self.path / MANIFEST)
            manifest = on_disk if isinstance(on_disk, dict) else self.manifest
            manifest.setdefault("metrics", {})[key] = value
            _write_json_atomic(self.path / MANIFEST, manifest)
        self.manifest = manifest

    def lineage_entry(self) -> dict:
        return {"stage": self.stage, "path": str(self.path.resolve()), "content_hash": self.content_hash,
                "config": self.manifest["config"], "created_at": self.manifest.get("created_at")}


def _verified_record(path: Path, chash: str) -> Path:
    """Where the stat record of a verified artifact lives (keyed by its real path and content hash)."""
    root = os.environ.get("LLMOPT_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") \
        / "llmopt"
    key = hashlib.sha256(f"{Path(path).resolve()}\0{chash}".encode()).hexdigest()[:32]
    return Path(root) / "verified" / f"{key}.json"


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


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
    if not isinstance(manifest["files"], dict) or not all(isinstance(e, dict) for e in manifest["files"].values()):
        raise ArtifactError(f"{path}: manifest 'files' is not a mapping of file name to sha256 and size")
    if manifest["format_version"] > FORMAT_VERSION:
        raise ArtifactError(f"{path}: format version {manifest['format_version']} is newer than this llmopt "
                            f"understands ({FORMAT_VERSION}); upgrade llmopt")
    return manifest


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive advisory lock (flock) on `path` for the block: processes that lock the same path run their
    blocks one at a time. A folder is locked as it is; a file path is created empty if missing."""
    fd = os.open(path, os.O_RDONLY if Path(path).is_dir() else os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")
    text = json.dumps(data, indent=2) + "\n"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        code = disk_full_errno(e)
        if code is not None:
            raise ArtifactError(disk_full_message(path, path.parent, code, 0, len(text.encode()))) from None
        raise


class ArtifactWriter:
    """Write an artifact into a temporary sibling; `commit` renames it into place.

    Entering removes the siblings an earlier, killed run left (their owner is gone; one logged line each)
    and claims the new one. Leaving the block without a commit (an error, Ctrl-C) removes the temporary
    directory, so an interrupted stage never leaves a partial artifact at the destination; a full disk
    or quota becomes an ArtifactError naming the output, the space needed and the space free.
    """

    def __init__(self, dest: str | Path, force: bool = False):
        self.dest = Path(dest)
        self.force = force
        self.tmp = self.dest.parent / f"{TMP_PREFIX}{self.dest.name}-{uuid.uuid4().hex[:8]}"
        self.committed: Artifact | None = None
        self.expected: int | None = None  # bytes the stage said it will write (`check_space`)

    def __enter__(self) -> "ArtifactWriter":
        check_destination(self.dest, self.force)
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        sweep_leftovers(self.dest.parent)
        self.tmp.mkdir()
        try:
            claim(self.tmp)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        return self

    def check_space(self, nbytes: int) -> None:
        """Say how many bytes the artifact will take: ArtifactError now if the filesystem has less free."""
        self.expected = int(nbytes)
        check_space(self.dest, self.tmp, self.expected)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.committed is not None:
            return
        written = tree_bytes(self.tmp)
        shutil.rmtree(self.tmp, ignore_errors=True)
        code = disk_full_errno(exc)
        if code is not None:
            raise ArtifactError(disk_full_message(self.dest, self.dest.parent, code, written, self.expected)) \
                from None

    def commit(self, stage: str, config: dict, parent: Artifact | None, source: dict,
               model: dict | None = None, metrics: dict | None = None) -> Artifact:
        apply_umask(self.tmp)
        skip = (self.tmp / MANIFEST, self.tmp / OWNER)
        files = {p.relative_to(self.tmp).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                 for p in sorted(self.tmp.rglob("*")) if p.is_file() and p not in skip}
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
        """Rename the finished directory into place. A replaced artifact first moves into a claimed sibling,
        so a crash between the two renames leaves only directories the next write knows to remove."""
        old = None
        if self.dest.exists():
            old = self.dest.parent / f"{TMP_PREFIX}{self.dest.name}-old-{uuid.uuid4().hex[:8]}"
            old.mkdir()
            claim(old)
            os.replace(self.dest, old / "replaced")
        os.replace(self.tmp, self.dest)
        (self.dest / OWNER).unlink(missing_ok=True)
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
