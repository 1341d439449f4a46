"""`run_export`: an artifact (or any model source) as one GGUF file for llama.cpp.

Plans every tensor first (plan.py: exact Q4_0 / Q8_0 re-packing, dense as stored, re-quantizing only where
allowed), so a refusal comes before anything is written; then writes the metadata (architecture, tokenizer,
chat template, the artifact's lineage under `llmopt.*`) and streams the tensors one at a time from the
memory-mapped artifact into a temporary file that replaces the destination when it is whole.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..artifact import tool_version
from ..compressed import LinearScheme, parse_schemes
from ..errors import ArtifactError, ConfigError
from ..layerwise import one_thread
from ..progress import StageHooks
from ..safetensors_io import load_dir, weight_files
from ..source import as_artifact, resolve, source_record
from . import llama
from .config import ExportConfig
from .gguf_meta import source_strings
from .plan import REQUANTIZED, TensorPlan, file_order, plan_dense, plan_quantized, refuse
from .tensors import tensor_data
from .vocab import read_vocab, write_vocab
from .write import atomic_file, check_file_destination

CODE_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
SOURCE_GENERAL = ("general.name", "general.type", "general.basename", "general.finetune", "general.organization",
                  "general.size_label", "general.license")
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q4_0": "MOSTLY_Q4_0",
              "Q4_1": "MOSTLY_Q4_1", "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1", "Q8_0": "MOSTLY_Q8_0"}


@dataclass
class ExportResult:
    """What was written: the file, every tensor's plan, the tokenizer record and the lineage."""

    path: Path
    bytes: int
    seconds: float
    file_type: str
    tensors: list[TensorPlan]
    tokenizer: dict
    lineage: list[dict] = field(default_factory=list)

    @property
    def requantized(self) -> list[TensorPlan]:
        return [t for t in self.tensors if t.how == REQUANTIZED]

    def counts(self) -> dict[str, dict[str, int]]:
        """how (exact, requantized, dense) -> GGUF type -> number of tensors."""
        out: dict[str, Counter] = {}
        for t in self.tensors:
            out.setdefault(t.how, Counter())[t.qtype] += 1
        return {how: dict(c) for how, c in out.items()}

    def to_dict(self) -> dict:
        return {"path": str(self.path), "bytes": self.bytes, "seconds": self.seconds, "file_type": self.file_type,
                "counts": self.counts(), "requantized": [t.record() for t in self.requantized],
                "tokenizer": self.tokenizer, "lineage": [e.get("stage") for e in self.lineage],
                "tensors": [t.record() for t in self.tensors]}


@dataclass
class SourceModel:
    """The source as the export reads it: where, its config, its state dict (memory-mapped), its record."""

    directory: Path
    config: dict
    state: dict
    source: dict
    manifest: dict | None


def run_export(source_ref: str, dest: Path, config: ExportConfig, force: bool = False,
               hooks: StageHooks | None = None) -> ExportResult:
    """Write `source_ref` (an artifact, or any model source) as a GGUF file at `dest`."""
    hooks = hooks or StageHooks()
    config.validate()
    dest = Path(dest)
    check_file_destination(dest, force)  # before any loading, so a typo costs nothing
    start = time.perf_counter()
    model = _read(source_ref, hooks)  # an artifact opens silently; a GGUF source's first import says so
    schemes = _schemes(model)
    with one_thread():  # a few small ops per tensor: threads only add synchronisation (100x slower on a busy CPU)
        plans = plan_tensors(model, schemes, config.allow_requantize)
        refuse(plans)
        vocab = read_vocab(model.directory, _rows_of_embedding(plans), config.tokenizer_pre, model.source)
        hooks.status(f"writing {dest}")
        with atomic_file(dest, force, sum(p.nbytes for p in plans)) as tmp:
            tokenizer, file_type = _write(tmp, model, plans, schemes, vocab, config)
    lineage = (model.manifest or {}).get("lineage", [])
    return ExportResult(dest, dest.stat().st_size, round(time.perf_counter() - start, 1), file_type, plans,
                        tokenizer, lineage)


def _read(source_ref: str, hooks: StageHooks) -> SourceModel:
    source = resolve(str(source_ref))
    art = as_artifact(source, progress=hooks.status)
    if art is not None and art.tensor_parallel:
        raise ConfigError(f"export: {source_ref} is sharded for {art.sharding}; "
                          "export the artifact it was sharded from")
    directory = art.path if art else source.path
    try:
        model_config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{directory}/config.json cannot be read ({e})") from None
    llama.check_config(model_config)
    state = load_dir(directory, art.weight_files if art else weight_files(directory))
    return SourceModel(directory, model_config, state, source_record(source, art), art.manifest if art else None)


def _schemes(model: SourceModel) -> dict[str, LinearScheme]:
    """Each quantized module -> its scheme, from config.json's compressed-tensors quantization_config."""
    qconfig = model.config.get("quantization_config")
    if not qconfig:
        return {}
    if qconfig.get("quant_method") != "compressed-tensors":
        raise ConfigError(f"export: {qconfig.get('quant_method')} checkpoints cannot be exported to GGUF; export "
                          "the artifact they were quantized from, or quantize with rtn, gptq or awq")
    modules = {k.rsplit(".", 1)[0] for k, t in model.state.items()
               if k.endswith(".weight_packed") or (k.endswith(".weight") and t.dim() == 2)}  # no norms
    embeddings = [m for m in modules if m.endswith("embed_tokens")]
    return parse_schemes(qconfig, sorted(m for m in modules if m not in embeddings), embeddings)


def plan_tensors(model: SourceModel, schemes: dict[str, LinearScheme], allow: str | None) -> list[TensorPlan]:
    """Every tensor's plan, in llama.cpp's file order (the tied lm_head is left out: llama.cpp reuses token_embd);
    ConfigError for a model llama.cpp's Llama cannot hold."""
    layers = 1 + max((llama.layer_of(k) for k in model.state if llama.layer_of(k) is not None), default=-1)
    if layers != int(model.config["num_hidden_layers"]):
        raise ConfigError(f"export: {layers} layers in the weights, {model.config['num_hidden_layers']} in config.json")
    gguf_name = llama.tensor_names(layers)
    plans = []
    for module, scheme in schemes.items():
        name = f"{module}.weight"
        shape, scale = _code_shape(model.state, module, scheme), model.state[f"{module}.weight_scale"]
        plans.append(plan_quantized(name, gguf_name(name), module, scheme, shape, scale, allow,
                                    llama.rotary_heads(name, model.config)))
    for name, tensor in model.state.items():
        module, _, suffix = name.rpartition(".")
        if module in schemes and (suffix in CODE_SUFFIXES or suffix == "weight"):
            continue
        if name == "lm_head.weight" and model.config.get("tie_word_embeddings"):
            continue
        plans.append(plan_dense(name, gguf_name(name), tensor, llama.rotary_heads(name, model.config)))
    mlp_width(plans)
    return sorted(plans, key=file_order)


def mlp_width(plans: list[TensorPlan]) -> int:
    """The one intermediate size of the MLPs (a model pruned to different widths per layer is refused)."""
    widths = {p.shape[0] for p in plans if p.gguf_name.endswith("ffn_gate.weight")}
    if len(widths) != 1:
        raise ConfigError(f"export: the MLPs differ in width ({sorted(widths)}); llama.cpp's Llama takes one width")
    return widths.pop()


def _code_shape(state: dict, module: str, scheme: LinearScheme) -> tuple[int, int]:
    if scheme.activations:
        return tuple(state[f"{module}.weight"].shape)
    return tuple(int(v) for v in state[f"{module}.weight_shape"].tolist())


def _rows_of_embedding(plans: list[TensorPlan]) -> int:
    for p in plans:
        if p.gguf_name == "token_embd.weight":
            return p.shape[0]
    raise ConfigError("export: the model has no input embedding (model.embed_tokens)")


def _file_type(plans: list[TensorPlan]) -> str:
    """llama.cpp's general.file_type: the type of most of the decoder blocks' weights (as llama-quantize names a
    file by its target type, whatever its embedding and output are)."""
    sizes = Counter()
    for p in plans:
        if len(p.shape) == 2 and p.gguf_name.startswith("blk."):
            sizes[p.qtype] += p.shape[0] * p.shape[1]
    return FILE_TYPES.get(sizes.most_common(1)[0][0], "GUESSED") if sizes else "ALL_F32"


def _write(path: Path, model: SourceModel, plans: list[TensorPlan], schemes: dict, vocab, config: ExportConfig):
    import gguf

    writer = gguf.GGUFWriter(path, llama.ARCH)
    try:
        file_type = _write_metadata(writer, model, plans, vocab, config)
        tokenizer = write_vocab(writer, vocab)
        for p in plans:
            _add_info(writer, p)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for p in plans:
            writer.write_tensor_data(tensor_data(p, model.state, schemes))
    finally:
        writer.close()
    return tokenizer, file_type


def _add_info(writer, p: TensorPlan) -> None:
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[p.qtype]
    if p.qtype in ("F32", "F16"):
        writer.add_tensor_info(p.gguf_name, p.shape, np.dtype(np.float32 if p.qtype == "F32" else np.float16),
                               p.nbytes, raw_dtype=qtype)
    else:  # block types and BF16 go in as their bytes
        writer.add_tensor_info(p.gguf_name, gguf.quant_shape_to_byte_shape(p.shape, qtype), np.dtype(np.uint8),
                               p.nbytes, raw_dtype=qtype)


def _write_metadata(writer, model: SourceModel, plans: list[TensorPlan], vocab, config: ExportConfig) -> str:
    import gguf

    general = source_strings(model.source, SOURCE_GENERAL)  # the model's own name, license, ... if a GGUF had them
    writer.add_name(general.pop("general.name", model.directory.name))
    for key, value in general.items():
        writer.add_string(key, value)
    llama.write_hparams(writer, llama.hparams(model.config, int(model.config["num_hidden_layers"]), mlp_width(plans),
                                              len(vocab.tokens)))
    file_type = _file_type(plans)
    writer.add_file_type(gguf.LlamaFileType[file_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    manifest = model.manifest or {}
    writer.add_string("llmopt.lineage", json.dumps(manifest.get("lineage", [])))
    writer.add_string("llmopt.source", json.dumps(model.source))
    writer.add_string("llmopt.export", json.dumps({
        "tool_version": tool_version(), "config": config.to_dict(), "artifact": str(model.directory),
        "content_hash": manifest.get("content_hash"),
        "requantized": [p.record() for p in plans if p.how == REQUANTIZED]}))
    return file_type

