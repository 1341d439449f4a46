"""`llmopt serve --api-keys-file`: the tenants it reads, and each mistake as one line and exit 2."""
from __future__ import annotations

import pytest

from llmopt.cli.main import main
from llmopt.stages.serve.http.tenants import default_name


def test_the_tenants_come_from_the_file_and_their_keys_stay_out_of_reprs(served, model_dir, tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  - key: s3cret-a\n    name: team-a\n    max_concurrency: 2\n"
                    "  - {key: s3cret-b, tokens_per_minute: 1000}\n")
    assert main(["serve", str(model_dir), "--api-keys-file", str(path)]) == 0
    a, b = served[0].tenants
    assert (a.name, a.key, a.max_concurrency, a.tokens_per_minute) == ("team-a", "s3cret-a", 2, None)
    assert b.name == default_name("s3cret-b") and b.tokens_per_minute == 1000 and "s3cret" not in b.name
    assert "s3cret" not in repr(served[0]) + repr(a)


@pytest.mark.parametrize("content, expect", [
    (None, "cannot read it"),
    ("keys: [", "not valid YAML"),
    ("- key: k\n", "expected a mapping with one key, 'keys'"),
    ("keys: []\n", "non-empty list"),
    ("keys: [k]\n", "entry 1: expected a mapping"),
    ("keys:\n  - name: x\n", "entry 1: 'key' must be"),
    ("keys:\n  - {key: a}\n  - {key: 'b c'}\n", "entry 2: 'key' must be"),
    ("keys:\n  - {key: a, rpm: 3}\n", "entry 1: unknown field 'rpm'"),
    ("keys:\n  - {key: a, name: x, max_concurrency: 0}\n", "entry 1 (x): 'max_concurrency' must be"),
    ("keys:\n  - {key: a, tokens_per_minute: lots}\n", "'tokens_per_minute' must be a whole number"),
    ("keys:\n  - {key: a, max_concurrency: true}\n", "'max_concurrency' must be"),
    ("keys:\n  - {key: a, name: x}\n  - {key: a, name: y}\n", "entry 2 (y) repeats the key"),
    ("keys:\n  - {key: a, name: x}\n  - {key: b, name: x}\n", "entry 2 repeats the name 'x'"),
])
def test_a_bad_keys_file_is_one_line_and_exit_2(served, model_dir, tmp_path, capsys, content, expect):
    path = tmp_path / "keys.yaml"
    if content is not None:
        path.write_text(content)
    assert main(["serve", str(model_dir), "--api-keys-file", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: --api-keys-file {path}") and expect in err
    assert not served


@pytest.mark.parametrize("other", [["--api-key", "k"], ["--api-key-file", "/dev/null"]])
def test_one_key_and_a_keys_file_are_one_too_many(served, model_dir, tmp_path, capsys, other):
    path = tmp_path / "keys.yaml"
    path.write_text("keys: [{key: a}]\n")
    assert main(["serve", str(model_dir), "--api-keys-file", str(path), *other]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not both" in err and not served
