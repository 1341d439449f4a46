"""Temporary directories a killed run leaves: removed by the next write when their owner is gone, never otherwise."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from llmopt.stages.artifact import MANIFEST, TMP_PREFIX, Artifact, ArtifactWriter
from llmopt.stages.tempdirs import OWNER, owner_record, sweep_leftovers

# a writer that claims its temporary directory, writes a file into it, says where, then waits to be killed
_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from llmopt.stages.artifact import ArtifactWriter
    w = ArtifactWriter(Path(sys.argv[1])).__enter__()
    (w.tmp / "model.safetensors").write_bytes(b"x" * 300_000)
    print(w.tmp, flush=True)
    time.sleep(60)
""")

# the next write into the same parent, as a stage would do it (its log lines go to stderr)
_NEXT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from llmopt.stages.artifact import ArtifactWriter
    with ArtifactWriter(Path(sys.argv[1])) as w:
        (w.tmp / "config.json").write_text("{}")
        w.commit("import", {}, None, {"kind": "test"})
""")


def _leftover(parent, name: str, record: dict | None):
    path = parent / f"{TMP_PREFIX}{name}"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"w" * 1000)
    if record is not None:
        (path / OWNER).write_text(json.dumps(record))
    return path


def _commit(dest):
    with ArtifactWriter(dest) as w:
        (w.tmp / "config.json").write_text("{}")
        w.commit("import", {}, None, {"kind": "test"})
    return w


def test_kill_9_leftover_is_removed_by_the_next_write_with_a_message(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path / "q")], stdout=subprocess.PIPE, text=True)
    try:
        tmp = tmp_path / os.path.basename(writer.stdout.readline().strip())
        assert tmp.name.startswith(f"{TMP_PREFIX}q-") and (tmp / OWNER).is_file()
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    assert tmp.is_dir()  # SIGKILL gave it no chance to clean up
    done = subprocess.run([sys.executable, "-c", _NEXT, str(tmp_path / "other")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not tmp.exists()
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert str(tmp) in lines[0] and f"pid {writer.pid} is no longer running" in lines[0] and "KiB" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]
    assert not (tmp_path / "other" / OWNER).exists() and Artifact.open(tmp_path / "other")


def test_reused_pid_counts_as_gone(tmp_path):
    record = {**owner_record(), "start_time": owner_record()["start_time"] - 1}  # our pid, another process's start
    path = _leftover(tmp_path, "x-1", record)
    lines = sweep_leftovers(tmp_path)
    assert not path.exists() and lines == [lines[0]] and "now belongs to another process" in lines[0]


def test_previous_boot_counts_as_gone(tmp_path):
    path = _leftover(tmp_path, "x-2", {**owner_record(), "boot_id": "not-this-boot"})
    assert "restarted" in sweep_leftovers(tmp_path)[0] and not path.exists()


def test_what_llmopt_cannot_prove_dead_is_kept(tmp_path, caplog):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone_pid = int(dead.stdout)
    kept = [
        _leftover(tmp_path, "live-1", owner_record()),  # this very process
        _leftover(tmp_path, "foreign-1", {**owner_record(), "host": "another-host", "pid": gone_pid}),
        _leftover(tmp_path, "norecord-1", None),  # older llmopt, or not ours
        _leftover(tmp_path, "garbled-1", None),
    ]
    (kept[-1] / OWNER).write_text("{not json")
    outside = tmp_path.parent / f"{tmp_path.name}-target"
    outside.mkdir()
    (outside / OWNER).write_text(json.dumps({**owner_record(), "pid": gone_pid}))
    (tmp_path / f"{TMP_PREFIX}link-1").symlink_to(outside)  # a link to a dead owner's folder: not followed
    (tmp_path / f"{TMP_PREFIX}file-1").write_text("a file, not a directory")
    dead_one = _leftover(tmp_path, "dead-1", {**owner_record(), "pid": gone_pid})  # the one that goes
    _commit(tmp_path / "out")
    assert all(p.is_dir() for p in kept) and (outside / OWNER).is_file()
    assert (tmp_path / f"{TMP_PREFIX}file-1").is_file() and (tmp_path / f"{TMP_PREFIX}link-1").is_symlink()
    assert not dead_one.exists()
    removed = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
    assert len(removed) == 1 and str(dead_one) in removed[0]


def test_dead_owner_in_another_folder_is_left_alone(tmp_path):
    other = tmp_path / "elsewhere"
    other.mkdir()
    record = {**owner_record(), "start_time": owner_record()["start_time"] - 1}
    path = _leftover(other, "x-3", record)
    (tmp_path / "here").mkdir()
    _commit(tmp_path / "here" / "out")
    assert path.is_dir()  # only the parent being written to is swept


def test_replacing_an_artifact_leaves_no_sibling_and_no_owner_file(tmp_path):
    _commit(tmp_path / "out")
    with ArtifactWriter(tmp_path / "out", force=True) as w:
        (w.tmp / "config.json").write_text('{"v": 2}')
        w.commit("import", {}, None, {"kind": "test"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", MANIFEST]
