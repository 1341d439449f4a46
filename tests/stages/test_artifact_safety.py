"""Writing artifacts on a full disk, file names that leave the artifact, file modes, and weight file sizes."""
import errno
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from llmopt.cli.main import main
from llmopt.stages.artifact import MANIFEST, TMP_PREFIX, Artifact, ArtifactWriter, member_path
from llmopt.stages.errors import ArtifactError
from llmopt.stages.importer import import_source
from llmopt.stages.model_io import load_model_dir
from llmopt.stages.safetensors_io import INDEX_NAME, ShardWriter, load_dir, weight_files
from llmopt.stages.source import resolve


@pytest.fixture
def base(tiny_hf, tmp_path):
    return import_source(resolve(str(tiny_hf[0])), tmp_path / "base")


def _error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


# ---- full disk -------------------------------------------------------------------------------------

def _enospc_after(monkeypatch, fraction: float, make_error):
    """Make safetensors' save_file write part of its file, then fail as a full disk would."""
    import safetensors.torch

    def save_file(tensors, filename, metadata=None):
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(filename, "wb") as f:
            f.write(b"\0" * int(size * fraction))
        raise make_error()

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


@pytest.mark.parametrize("make_error, says", [
    (lambda: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "no space left on device"),
    (lambda: OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)), "disk quota exceeded"),
    # what safetensors raises: the errno survives only in the message
    (lambda: __import__("safetensors").SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"), "no space left on device"),
], ids=["ENOSPC", "EDQUOT", "SafetensorError"])
def test_disk_full_while_writing_is_one_line_exit_2_and_leaves_nothing(tiny_hf, tmp_path, monkeypatch, capsys,
                                                                       make_error, says):
    _enospc_after(monkeypatch, 0.5, make_error)
    out = tmp_path / "out"
    assert main(["import", str(tiny_hf[0]), "-o", str(out)]) == 2
    lines = _error_lines(capsys)
    error = [line for line in lines if line.startswith("error:")]
    assert len(error) == 1 and "internal error" not in error[0]
    assert f"cannot write {out}: {says} after" in error[0] and "nothing was kept" in error[0]
    assert re.search(r"it needs more than .* on .* \(the weights alone are about 1\d\d\.\d KiB\)", error[0])
    assert list(tmp_path.iterdir()) == []


def test_too_little_free_space_is_refused_before_writing(tiny_hf, tmp_path, monkeypatch):
    import llmopt.stages.tempdirs as tempdirs

    monkeypatch.setattr(tempdirs, "free_bytes", lambda path: 50_000)  # the tiny model needs ~110 KiB
    written = []
    import safetensors.torch
    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **k: written.append(a))
    with pytest.raises(ArtifactError, match=r"cannot write .*out: it needs about 11\d\.\d KiB, only 48\.8 KiB free"):
        import_source(resolve(str(tiny_hf[0])), tmp_path / "out")
    assert written == [] and list(tmp_path.iterdir()) == []


def test_disk_full_while_storing_a_metric_keeps_the_manifest(base, monkeypatch):
    import llmopt.stages.artifact as artifact

    before = (base.path / MANIFEST).read_text()

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(artifact.os, "fsync", fsync)
    with pytest.raises(ArtifactError, match="no space left on device"):
        base.update_metrics("eval/x", {"perplexity": 1.0})
    monkeypatch.undo()
    assert (base.path / MANIFEST).read_text() == before
    assert not [p for p in base.path.iterdir() if p.name.startswith(TMP_PREFIX)]


@pytest.fixture
def small_tmpfs(tmp_path):
    """mount(size) -> a fresh tmpfs of `size` bytes (root only; skipped with the reason otherwise)."""
    mounted = []

    def mount(size: int):
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        path = tmp_path / f"fs{len(mounted)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_import_into_a_tmpfs_too_small_says_needed_and_free(tiny_hf, small_tmpfs, capsys):
    fs = small_tmpfs(64 * 1024)  # the tiny model's weights alone are ~110 KiB
    assert main(["import", str(tiny_hf[0]), "-o", str(fs / "out")]) == 2
    error = [line for line in _error_lines(capsys) if line.startswith("error:")]
    assert len(error) == 1
    assert f"cannot write {fs / 'out'}: it needs about 11" in error[0] and f"KiB free on {fs}" in error[0]
    assert list(fs.iterdir()) == []


def test_import_that_fills_a_tmpfs_half_way_leaves_nothing(tiny_hf, small_tmpfs, capsys):
    from llmopt.stages.safetensors_io import state_bytes

    pages = -(-state_bytes(tiny_hf[1].state_dict()) // 4096)
    # room for the weights (+1 page for the owner record) but not for the config and tokenizer files written first
    fs = small_tmpfs((pages + 2) * 4096)
    assert main(["import", str(tiny_hf[0]), "-o", str(fs / "out")]) == 2
    error = [line for line in _error_lines(capsys) if line.startswith("error:")]
    assert len(error) == 1 and "internal error" not in error[0]
    assert f"cannot write {fs / 'out'}: no space left on device after" in error[0] and "nothing was kept" in error[0]
    assert re.search(rf"KiB free on {re.escape(str(fs))} \(the weights alone are about 1\d\d\.\d KiB\)", error[0])
    assert list(fs.iterdir()) == []


# ---- file names that leave the artifact ------------------------------------------------------------

def _list(art_path, name: str):
    manifest = json.loads((art_path / MANIFEST).read_text())
    manifest["files"][name] = {"sha256": "0" * 64, "bytes": 1}
    (art_path / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def secret(tmp_path):
    """A file outside every artifact, which no crafted entry may get read."""
    path = tmp_path / "outside" / "secret.safetensors"
    path.parent.mkdir()
    shutil.copy(__import__("safetensors").__file__, path)
    return path


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink", "symlinked-folder"])
def test_manifest_entries_leaving_the_artifact_are_refused(base, secret, kind, capsys):
    name = {"absolute": str(secret), "dotdot": f"../outside/{secret.name}", "symlink": "evil.safetensors",
            "symlinked-folder": "rank-00/secret.safetensors"}[kind]
    if kind == "symlink":
        (base.path / name).symlink_to(secret)
    if kind == "symlinked-folder":
        (base.path / "rank-00").symlink_to(secret.parent, target_is_directory=True)
    _list(base.path, name)
    reason = {"absolute": "is an absolute path", "dotdot": "climbs out with '..'"}.get(kind, "is a symlink to")
    for verify in (True, False):
        with pytest.raises(ArtifactError, match=re.escape(f"llmopt.json files: entry '{name}' {reason}")):
            Artifact.open(base.path, verify=verify)
    for command in (["inspect", str(base.path), "--no-verify"], ["inspect", str(base.path)]):
        assert main(command) == 2
        error = [line for line in _error_lines(capsys) if line.startswith("error:")]
        assert len(error) == 1 and name in error[0]


@pytest.fixture
def hf_copy(tiny_hf, tmp_path):
    path = tmp_path / "hf"
    shutil.copytree(tiny_hf[0], path)
    return path


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink"])
def test_index_weight_map_entries_leaving_the_directory_are_refused(hf_copy, secret, kind, capsys):
    name = {"absolute": str(secret), "dotdot": f"../outside/{secret.name}", "symlink": "model-2.safetensors"}[kind]
    if kind == "symlink":
        (hf_copy / name).symlink_to(secret)
    weight_map = {"model.norm.weight": "model.safetensors", "model.embed_tokens.weight": name}
    (hf_copy / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    pattern = re.escape(f"{INDEX_NAME} weight_map['model.embed_tokens.weight']: entry '{name}'")
    with pytest.raises(ArtifactError, match=pattern):
        weight_files(hf_copy)
    with pytest.raises(ArtifactError, match=pattern):
        load_model_dir(hf_copy)
    for command in (["inspect", str(hf_copy)], ["import", str(hf_copy), "-o", str(hf_copy.parent / "x")]):
        assert main(command) == 2
        error = [line for line in _error_lines(capsys) if line.startswith("error:")]
        assert len(error) == 1 and "model.embed_tokens.weight" in error[0] and name in error[0]


def test_weight_files_given_directly_are_checked_too(hf_copy, secret):
    (hf_copy / "evil.safetensors").symlink_to(secret)
    with pytest.raises(ArtifactError, match="entry 'evil.safetensors' is a symlink to"):
        load_dir(hf_copy, ["evil.safetensors"])


def test_links_inside_the_directory_and_hub_snapshots_are_allowed(tmp_path):
    snapshot = tmp_path / "models--x" / "snapshots" / "abc123"
    blobs = tmp_path / "models--x" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "f00d").write_bytes(b"weights")
    (snapshot / "model.safetensors").symlink_to("../../blobs/f00d")  # how huggingface_hub lays out its cache
    (snapshot / "sub").mkdir()
    (snapshot / "alias.safetensors").symlink_to("sub")
    assert member_path(snapshot, "model.safetensors", "x").read_bytes() == b"weights"
    assert member_path(snapshot, "alias.safetensors", "x") == snapshot / "alias.safetensors"
    elsewhere = tmp_path / "plain"
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").symlink_to(blobs / "f00d")
    with pytest.raises(ArtifactError, match="outside"):
        member_path(elsewhere, "model.safetensors", "x")


def test_shard_refuses_to_copy_a_file_linked_from_outside(base, secret, tmp_path):
    from llmopt.stages.shard.config import ShardConfig
    from llmopt.stages.shard.run import run_shard

    shutil.copytree(base.path, tmp_path / "hf2", ignore=shutil.ignore_patterns(MANIFEST))
    (tmp_path / "hf2" / "notes.txt").symlink_to(secret)
    with pytest.raises(ArtifactError, match="entry 'notes.txt' is a symlink to"):
        run_shard(str(tmp_path / "hf2"), tmp_path / "sharded", ShardConfig(tp=2))
    assert not (tmp_path / "sharded").exists()


# ---- file modes ------------------------------------------------------------------------------------

_WRITE = textwrap.dedent("""
    import sys
    import numpy as np
    from pathlib import Path
    from safetensors.numpy import save_file
    from llmopt.stages.artifact import ArtifactWriter
    with ArtifactWriter(Path(sys.argv[1])) as w:
        save_file({"a": np.zeros(4, dtype=np.float32)}, str(w.tmp / "model.safetensors"))  # made 0600
        (w.tmp / "rank-00").mkdir()
        save_file({"b": np.ones(2, dtype=np.float32)}, str(w.tmp / "rank-00" / "model.safetensors"))
        (w.tmp / "config.json").write_text("{}")
        w.commit("import", {}, None, {"kind": "test"})
""")


@pytest.mark.parametrize("umask, file_mode, dir_mode", [("022", 0o644, 0o755), ("027", 0o640, 0o750)])
def test_every_file_follows_the_umask(tmp_path, umask, file_mode, dir_mode):
    out = tmp_path / "out"
    script = f"umask {umask} && exec {sys.executable} -c '{_WRITE}' {out}"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    modes = {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [out, *out.rglob("*")]}
    assert modes == {".": dir_mode, "rank-00": dir_mode, "rank-00/model.safetensors": file_mode,
                     "model.safetensors": file_mode, "config.json": file_mode, MANIFEST: file_mode}


def test_a_real_stage_writes_weights_with_the_umask(tiny_hf, tmp_path):
    old = os.umask(0o027)
    try:
        art = import_source(resolve(str(tiny_hf[0])), tmp_path / "out")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in art.path.iterdir()}
    assert set(modes.values()) == {0o640} and "model.safetensors" in modes


# ---- how weights are split into files --------------------------------------------------------------

def test_w4a16_artifact_is_one_file_below_the_limit(tiny_hf, tmp_path):
    """The docs' rule: one model.safetensors up to 2 GiB (the layer-wise writer used to write a file per layer)."""
    from llmopt.stages.quantize.config import QuantizeConfig
    from llmopt.stages.quantize.run import run_quantize

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        art = run_quantize(str(tiny_hf[0]), tmp_path / "q", QuantizeConfig(method="rtn", scheme="W4A16",
                                                                            group_size=16, eval_windows=0))
    assert art.weight_files == ["model.safetensors"] and not (art.path / INDEX_NAME).exists()
    assert any(k.endswith("weight_packed") for k in load_dir(art.path, art.weight_files))


def test_shard_writer_fills_files_up_to_the_limit(tmp_path):
    torch.manual_seed(0)
    pieces = [{f"l{i}.w": torch.randn(100, 10), f"l{i}.b": torch.randn(10)} for i in range(7)]  # 4,040 B each
    writer = ShardWriter(tmp_path, max_bytes=10_000)
    for piece in pieces:
        writer.add(piece)
    names = writer.close()
    assert names == [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)]  # 2+2+2+1 pieces
    sizes = [sum(t.numel() * t.element_size() for t in load_dir(tmp_path, [n]).values()) for n in names]
    assert max(sizes) <= 10_000
    state = load_dir(tmp_path, weight_files(tmp_path))
    assert all(torch.equal(state[k], v) for piece in pieces for k, v in piece.items())


def test_shard_writer_refuses_a_tensor_twice(tmp_path):
    writer = ShardWriter(tmp_path)
    writer.add({"a": torch.ones(2)})
    with pytest.raises(ValueError, match="written twice: a"):
        writer.add({"a": torch.zeros(2)})
    assert writer.close() == ["model.safetensors"]  # pending pieces are written on close
