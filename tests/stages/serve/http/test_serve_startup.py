"""What `llmopt serve` says and checks when it starts: the API key from a file, the warning of a public
bind (see test_connections.py for the process), a model that fails to load as one line and exit 2."""
from __future__ import annotations

import subprocess
import sys

import pytest

from llmopt.cli.main import main

from .serve_process import TINY, free_port


def test_the_api_key_comes_from_a_file_and_stays_out_of_the_config_repr(served, model_dir, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("  s3cret-key\n")
    assert main(["serve", str(model_dir), "--api-key-file", str(key_file)]) == 0
    assert served[0].api_key == "s3cret-key" and "s3cret" not in repr(served[0])


@pytest.mark.parametrize("name, content, expect", [
    ("missing", None, "cannot read it (No such file or directory)"),
    (".", None, "cannot read it (Is a directory)"),
    ("empty", " \n", "the file is empty"),
    ("two", "a\nb\n", "one word"),
])
def test_a_bad_key_file_is_one_line_and_exit_2(served, model_dir, tmp_path, capsys, name, content, expect):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    assert main(["serve", str(model_dir), "--api-key-file", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: --api-key-file") and expect in err
    assert not served


def test_a_key_file_and_a_key_are_one_too_many(served, model_dir, tmp_path, capsys, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text("k")
    monkeypatch.setenv("LLMOPT_API_KEY", "other")
    assert main(["serve", str(model_dir), "--api-key-file", str(key_file)]) == 2
    assert "not both" in capsys.readouterr().err and not served


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("::", False),
                                            ("10.0.0.7", False), ("no-such-host.invalid", False)])
def test_which_hosts_are_loopback(host, loopback):
    from llmopt.stages.serve.http.server import is_loopback

    assert is_loopback(host) is loopback


def test_a_corrupted_artifact_is_one_line_and_exit_2(model_dir, tmp_path):
    artifact = tmp_path / "art"
    assert main(["import", str(model_dir), "-o", str(artifact)]) == 0
    weights = artifact / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    command = [sys.executable, "-m", "llmopt.cli.main", "serve", str(artifact), "--port", str(free_port()), *TINY]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "model.safetensors" in lines[0], done.stderr
