"""Writing one file atomically, as artifacts are written (stages/tempdirs.py): into a claimed temporary sibling
directory (`.llmopt-tmp-*`, with its owner record, so a killed run's leftovers are swept by the next write),
fsynced, then renamed into place. A failure or Ctrl-C leaves nothing at the destination; a full disk is one line.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ..errors import ArtifactError
from ..tempdirs import TMP_PREFIX, check_space, claim, disk_full_errno, disk_full_message, sweep_leftovers, tree_bytes

GGUF_MAGIC = b"GGUF"


def check_file_destination(dest: Path, force: bool) -> None:
    """Refuse to clobber: an existing GGUF file needs --force; a directory or any other file is never replaced."""
    dest = Path(dest)
    if dest.is_dir():
        raise ArtifactError(f"{dest} is a directory; give -o the path of the .gguf file to write")
    if not dest.exists():
        return
    if not force:
        raise ArtifactError(f"{dest} already exists; choose another -o or pass --force to replace it")
    with open(dest, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ArtifactError(f"{dest} exists and is not a GGUF file; refusing to replace it even with --force")


@contextmanager
def atomic_file(dest: Path, force: bool, expected: int):
    """Yields the temporary path to write; on a clean exit the file replaces `dest`. `expected`: the bytes it
    will take, checked against the free space first."""
    dest = Path(dest)
    check_file_destination(dest, force)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ArtifactError(f"cannot write {dest}: {e.strerror or e}") from None
    sweep_leftovers(dest.parent)
    check_space(dest, dest.parent, expected)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{dest.name}-", dir=dest.parent))
    try:
        claim(tmp)
        yield tmp / dest.name
        _fsync(tmp / dest.name)
        os.replace(tmp / dest.name, dest)
        _fsync(dest.parent)
    except BaseException as e:
        code = disk_full_errno(e)
        if code is not None:
            raise ArtifactError(disk_full_message(dest, dest.parent, code, tree_bytes(tmp), expected)) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
