"""Temporary output directories: who owns them, clearing those a crash left, and a full disk in one line.

A stage writes its artifact into a hidden sibling of the destination (`.llmopt-tmp-*`) and renames it
into place. A process killed with SIGKILL (or a power cut) cannot remove its sibling, so each one holds
an owner record (`OWNER`): host, pid, the pid's start time from /proc (a reused pid has another one) and
the boot id. The next write into the same parent removes the siblings whose owner is gone and logs one
line for each. A directory with no owner record, an unreadable one, one from another host or one whose
owner still runs is never touched: llmopt removes only what it made.

A full disk is checked twice: `check_space` before writing, against the expected size, and
`disk_full_errno` on whatever the writer raised (an OSError, or safetensors' SafetensorError that only
carries the errno in its message), so the stage fails with one line, never a traceback.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path

from .errors import ArtifactError

TMP_PREFIX = ".llmopt-tmp-"
OWNER = ".llmopt-owner.json"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)

log = logging.getLogger("llmopt.artifact")


# ---- owner records ---------------------------------------------------------------------------------

def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a live pid, from /proc; None without /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name (field 2) may hold spaces and parentheses
    return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def owner_record() -> dict:
    """This process as the owner of a temporary directory."""
    pid = os.getpid()
    stat = _proc_stat(pid)
    return {"pid": pid, "host": socket.gethostname(), "start_time": stat[1] if stat else None,
            "boot_id": _boot_id(), "created": time.time()}


def claim(directory: Path) -> None:
    """Write this process's owner record into a fresh temporary directory."""
    with open(directory / OWNER, "w") as f:
        json.dump(owner_record(), f)


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def owner_gone(record: dict) -> str | None:
    """Why the owner of `record` can no longer be writing ("pid 12 is no longer running"), or None while it
    may be: alive, on another host, or a record this check cannot judge."""
    pid = record.get("pid")
    if record.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return None
    boot = _boot_id()
    if record.get("boot_id") and boot and record["boot_id"] != boot:
        return f"pid {pid} ran before this machine restarted"
    if not _pid_running(pid):
        return f"pid {pid} is no longer running"
    stat = _proc_stat(pid)
    if stat is None:
        return None
    if stat[0] == "Z":
        return f"pid {pid} has exited"
    if record.get("start_time") is not None and stat[1] != record["start_time"]:
        return f"pid {pid} now belongs to another process"
    return None


def _read_owner(directory: Path) -> dict | None:
    path = directory / OWNER
    try:
        if not path.is_file() or path.is_symlink():
            return None
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def tree_bytes(directory: Path) -> int:
    """Bytes of the regular files under `directory` (symlinks not followed)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            total += st.st_size
    return total


def sweep_leftovers(parent: Path) -> list[str]:
    """Remove the temporary directories in `parent` whose owner is gone; one logged line (returned) each."""
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return []
    lines = []
    for entry in entries:
        if not entry.name.startswith(TMP_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        record = _read_owner(path)
        why = owner_gone(record) if record is not None else None
        if why is None:
            continue
        size = tree_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            lines.append(f"removed {path} ({human_size(size)}) left by an interrupted llmopt run: {why}")
            log.warning(lines[-1])
    return lines


# ---- disk space ------------------------------------------------------------------------------------

def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem holding `path` (None if unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def mount_point(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not os.path.ismount(path) and path.parent != path:
        path = path.parent
    return path


def human_size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def check_space(dest: Path, where: Path, needed: int) -> None:
    """ArtifactError (before anything is written) when the filesystem of `where` has less than `needed` free."""
    free = free_bytes(where)
    if free is not None and needed > free:
        raise ArtifactError(f"cannot write {dest}: it needs about {human_size(needed)}, only {human_size(free)} "
                            f"free on {mount_point(where)}; free some space or choose another -o")


_OS_ERROR = re.compile(r"os error (\d+)")


def disk_full_errno(exc: BaseException | None) -> int | None:
    """ENOSPC or EDQUOT when `exc` (or an exception it wraps) is a full disk or quota, else None."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in DISK_FULL:
            return exc.errno
        text = str(exc)
        match = _OS_ERROR.search(text)  # safetensors: "... I/O error: No space left on device (os error 28)"
        if match and int(match.group(1)) in DISK_FULL:
            return int(match.group(1))
        for code in DISK_FULL:
            if os.strerror(code) in text:
                return code
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def disk_full_message(dest: Path, where: Path, code: int, written: int, expected: int | None) -> str:
    """The one line for a write that ran out of space (or quota) after `written` bytes; what was written is gone."""
    weights = f" (the weights alone are about {human_size(expected)})" if expected else ""
    free = free_bytes(where)
    if code == errno.EDQUOT:
        room = f"it needs more than your quota leaves on {mount_point(where)}{weights}"
    elif free is None:
        room = f"it needs more than is free on {mount_point(where)}{weights}"
    else:
        room = f"it needs more than the {human_size(free)} free on {mount_point(where)}{weights}"
    return (f"cannot write {dest}: {os.strerror(code).lower()} after {human_size(written)}; {room}; "
            "nothing was kept (free some space or choose another -o)")


# ---- file modes ------------------------------------------------------------------------------------

def current_umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no /proc: read it by setting it (and putting it back at once)
    os.umask(mask)
    return mask


def apply_umask(directory: Path) -> None:
    """Give every file under `directory` the mode a plain open() would (0o666 less the umask), folders 0o777
    less it: some writers (safetensors) create their files 0600 through a temporary file."""
    mask = current_umask()
    for root, dirs, files in os.walk(directory):
        for name, mode in [(d, 0o777) for d in dirs] + [(f, 0o666) for f in files]:
            path = os.path.join(root, name)
            if not os.path.islink(path):  # a link's target is not ours to change
                os.chmod(path, mode & ~mask)
    os.chmod(directory, 0o777 & ~mask)


def fsync_tree(directory: Path) -> None:
    """Flush every file under `directory`, then every folder (their entries), to disk."""
    folders = [Path(directory)]
    for p in sorted(Path(directory).rglob("*")):
        if p.is_symlink():
            continue
        if p.is_dir():
            folders.append(p)
        elif p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for folder in reversed(folders):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
