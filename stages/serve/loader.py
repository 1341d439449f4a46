"""Load a Llama-family model source into the serve `Runtime`.

The runtime is built on the meta device; the projections are made from the memory-mapped
safetensors tensors (q/k/v and gate/up concatenated along the output dimension when they share a
scheme) by the backend (`llmopt.kernels.select_backend`, chosen once here), then the remaining tensors
(embedding, norms) are assigned without a copy unless the dtype or device changes. Quantized
artifacts (compressed-tensors W4A16/W8A16 pack-quantized, W8A8 int-quantized) hand each Linear's
tensors and the group size its config group records to the backend. An int8 embedding
(`--embeddings int8`) stays int8 in memory; a tied lm_head is then an int8 linear over the same codes.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from llmopt.kernels import Backend, KernelBackendError, build_cos_sin_cache, select_backend
from llmopt.kernels.cpu_native import cache_dir
from llmopt.kernels.layout_cache import LayoutCache, cached_layout, layout_key

from ..compressed import LinearScheme, decompress_linear, parse_schemes
from ..ctpack import pack_zero_point, unpack_zero_point
from ..errors import ArtifactError, ConfigError, SourceError
from ..model_io import parse_dtype
from ..safetensors_io import load_dir, weight_files
from ..families import LLAMA_PROJECTIONS, Family
from .model import NORM_BUFFERS, ConcatLinear, Runtime, spec_from_config
from .startup import phase

# What this file does to the tensors before the kernels see them (fused concatenations) is part of the
# layout cache's key too.
_LOADER_HASH = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]

PROJECTIONS = tuple(LLAMA_PROJECTIONS)  # the runtime's fused projections: qkv, o_proj, gate_up, down
EMBED = "model.embed_tokens"


def locate(ref: str) -> tuple[Path, list[str]]:
    """(directory, safetensors files) of any model source; GGUF sources go through the import cache."""
    from ..source import as_artifact, resolve

    source = resolve(str(ref))
    art = as_artifact(source)
    if art is not None:
        if art.tensor_parallel:
            raise ConfigError(f"{ref} is sharded for {art.sharding}; "
                              f"build an engine for it (llmopt serve / generate) to start its ranks")
        return art.path, art.weight_files
    return source.path, weight_files(source.path)


def sharded_artifact(ref):
    """The artifact behind `ref` if it is sharded for tensor parallelism (`llmopt shard`), else None."""
    from ..artifact import Artifact
    from ..source import resolve

    source = resolve(str(ref))
    if source.kind != "artifact":
        return None
    art = Artifact.open(source.path)
    return art if art.tensor_parallel else None


def load_runtime(ref, device="cpu", dtype=None, backend: "str | Backend" = "auto", startup=None):
    """(runtime, tokenizer, config dict) for a source ref (alias, GGUF, HF dir, artifact) or directory.

    dtype: None keeps the checkpoint's dtype (a torch.dtype or fp32/bf16/fp16 also work).
    backend: "auto" (the fastest for the device), "cpu-native", "cpu-torch", "triton" or "reference" (every
    op's exact torch twin), or a Backend built by the caller; ConfigError for one that cannot run here.
    startup: a `startup.StartupReport` that times the phases (artifact, tokenizer, weights, layouts).
    An artifact's kernel layouts come from the layout cache (`layout_cache_for`) once built.
    """
    from .tokenizer import load_serve_tokenizer

    with phase(startup, "artifact"):
        directory, files = locate(ref)
        config = read_config(directory)
        spec_from_config(config)  # refuse other architectures before touching any weights
        if not files:
            raise ArtifactError(f"{directory}: no safetensors weights (the serve runtime loads safetensors only)")
    with phase(startup, "tokenizer"):
        tokenizer = load_serve_tokenizer(directory)
    with phase(startup, "weights"):
        dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        state = load_dir(directory, files)
    with phase(startup, "layouts"):
        backend = _backend(backend, torch.device(device), dtype or _stored_dtype(state))
        layouts = layout_cache_for(directory, backend, dtype or _stored_dtype(state))
        runtime = build_runtime(config, state, torch.device(device), dtype, backend, layouts)
        if layouts is not None:
            layouts.save()
            if startup is not None:
                startup.notes["layouts"] = layouts.describe()
    return runtime, tokenizer, config


def layout_cache_for(directory: Path, backend: Backend, dtype: torch.dtype) -> LayoutCache | None:
    """The layout cache of an artifact's weights on `backend` (kernels/layout_cache.py), keyed by its content
    hash; None for a plain directory (no content hash to key it by) or a backend without CPU layouts."""
    from ..artifact import Artifact, is_artifact

    if not is_artifact(directory) or not backend.name.startswith("cpu"):
        return None
    identity = Artifact.open(directory, verify=False).content_hash + _LOADER_HASH
    return LayoutCache.open(cache_dir() / "layouts", layout_key(identity, backend.name, dtype))


def read_config(directory: Path) -> dict:
    """config.json as a dict; SourceError when it is missing or not JSON."""
    try:
        return json.loads((Path(directory) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SourceError(f"{directory}/config.json cannot be read ({e.__class__.__name__}: {e})") from None


def _no_scope(name: str):
    return contextlib.nullcontext()


def _stored_dtype(state: dict) -> torch.dtype:
    for name, t in state.items():
        if t.is_floating_point() and not name.endswith(("_scale", "_zero_point")):
            return t.dtype
    return torch.float32


def build_runtime(config: dict, state: dict, device: torch.device, dtype=None,
                  backend: "str | Backend" = "auto", layouts: LayoutCache | None = None) -> Runtime:
    """A Runtime for `config` with the tensors of `state` (HF names, compressed-tensors layout if quantized),
    its modules built by `backend` (a name for `select_backend`, or a Backend); their kernel layouts read
    from or kept for `layouts` (see `layout_cache_for`)."""
    scope = layouts.scope if layouts is not None else _no_scope
    spec = spec_from_config(config)
    qconfig = config.get("quantization_config")
    if qconfig and qconfig.get("quant_method") == "bitsandbytes":
        raise ConfigError("bitsandbytes artifacts cannot be served; quantize with --method rtn/gptq/awq/smoothquant")
    dtype = dtype or _stored_dtype(state)
    backend = _backend(backend, device, dtype)
    with torch.device("meta"):
        runtime = Runtime(spec, backend, dtype)
    family = spec.family
    weights = _Weights(state, qconfig, spec.num_layers, device, dtype, backend, family)
    for i, layer in enumerate(runtime.layers):
        for attr, parts in family.projections.items():
            with scope(f"layers.{i}.{attr}"):
                setattr(layer, attr, weights.linear([f"model.layers.{i}.{p}" for p in parts]))
    stage = config.get("llmopt_stage")  # a pipeline stage (stages/shard/pipeline.py): its own layers only
    head = stage is None or stage["head"]
    tied = spec.tie_word_embeddings or not weights.has("lm_head")
    runtime.load_state_dict(weights.rest(spec.num_layers, head), strict=False, assign=True)
    if stage is None or stage["embed"] or (head and tied):  # a tied head reads the embedding's table
        with scope("embed_tokens"):  # a quantized one is unpacked from int32 words: kept too
            runtime.embed_tokens, runtime.embed_scale = cached_layout("embedding", weights.embedding) \
                if EMBED in weights.schemes else weights.embedding()
    else:
        runtime.embed_tokens = torch.empty(0, spec.hidden_size, dtype=dtype, device=device)
    if head:
        with scope("lm_head"):
            runtime.lm_head = weights.tied_lm_head(runtime.embed_tokens, runtime.embed_scale) if tied \
                else weights.linear(["lm_head"])
    else:  # the final norm lives on the last stage; this one keeps the dtype and device it reports
        runtime.norm = torch.empty(0, dtype=dtype, device=device)
    ropes = dict.fromkeys(kind.rope for kind in spec.shape.kinds)
    runtime.rope_caches = [build_cos_sin_cache(spec.head_dim, spec.max_positions, rope.theta, rope.scaling_dict or None,
                                               device=device) for rope in ropes]
    on_meta = [f"{m}.{n}" if m else n for m, module in runtime.named_modules()
               for n, b in module.named_buffers(recurse=False)
               if b.device.type == "meta" and n not in getattr(module, "released", ())]
    if on_meta:
        raise ArtifactError(f"weights missing from the safetensors files: {', '.join(on_meta[:5])}")
    return runtime.eval()


def _backend(backend: "str | Backend", device: torch.device, dtype: torch.dtype) -> Backend:
    """The Backend itself, or the one `select_backend` picks for the name (ConfigError: it cannot run here)."""
    if not isinstance(backend, str):
        return backend
    try:
        return select_backend(backend, device, dtype)
    except KernelBackendError as e:  # one line that names the backend and why
        raise ConfigError(str(e)) from None


class _Weights:
    """The checkpoint's tensors, handed out as runtime modules on `device` in `dtype`."""

    def __init__(self, state: dict, qconfig: dict | None, num_layers: int, device, dtype, backend, family: Family):
        self.state, self.device, self.dtype, self.backend, self.family = state, device, dtype, backend, family
        names = [f"model.layers.{i}.{p}" for i in range(num_layers) for p in family.layer_linears()]
        self.schemes = parse_schemes(qconfig, names + ["lm_head"], [EMBED]) if qconfig else {}

    def has(self, name: str) -> bool:
        return any(k.startswith(name + ".") for k in self.state)

    def tensor(self, key: str) -> torch.Tensor:
        """The tensor on the runtime's device; dense floats in the runtime's dtype, scales as stored."""
        if key not in self.state:
            raise ArtifactError(f"tensor {key} is missing from the safetensors files")
        t = self.state[key]
        convert = t.is_floating_point() and not key.endswith("_scale")
        return t.to(device=self.device, dtype=self.dtype if convert else t.dtype)

    def rest(self, num_layers: int, head: bool = True) -> dict:
        """Norm weights under the runtime's names; a family's norm offset (Gemma: 1 + w) added in fp32 first.
        head: the final norm too (a pipeline stage before the last has none)."""
        out = {"norm": self.norm("model.norm.weight")} if head else {}
        for i in range(num_layers):
            for slot, theirs in self.family.norms.items():
                out[f"layers.{i}.{NORM_BUFFERS[slot]}"] = self.norm(f"model.layers.{i}.{theirs}.weight")
        return out

    def norm(self, key: str) -> torch.Tensor:
        offset = self.family.norm_offset
        if not offset:
            return self.tensor(key)
        if key not in self.state:
            raise ArtifactError(f"tensor {key} is missing from the safetensors files")
        return (self.state[key].float() + offset).to(device=self.device, dtype=self.dtype)

    def embedding(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(table, None) for a dense embedding; (int8 codes [vocab, H], scales [vocab, H/g]) for a quantized one."""
        scheme = self.schemes.get(EMBED)
        if scheme is None:
            return self.tensor(f"{EMBED}.weight"), None
        if scheme.bits != 8 or not scheme.symmetric or scheme.activations:
            raise ArtifactError(f"{EMBED}: {scheme.bits}-bit {'symmetric' if scheme.symmetric else 'asymmetric'} "
                                "embeddings cannot be served (symmetric int8 only, as `--embeddings int8` writes)")
        q, scale, _ = decompress_linear(self.state, EMBED, scheme)
        return q.to(self.device), scale.to(self.device)

    def tied_lm_head(self, table: torch.Tensor, scale: torch.Tensor | None) -> nn.Module:
        """A tied model's lm_head: the embedding matrix; an int8 one runs as an int8 linear on its codes."""
        if scale is None:
            return self.backend.dense_linear(table)
        return self.backend.quantized_linear("w8a16", {"weight": table, "weight_scale": scale},
                                             self.schemes[EMBED].group_size)

    def linear(self, names: list[str]) -> nn.Module:
        """One module computing the concatenated outputs of the Linears `names`."""
        schemes = {self.schemes.get(n) for n in names}
        if len(schemes) > 1:  # mixed schemes cannot share one weight: run them side by side
            return ConcatLinear([self.linear([n]) for n in names])
        scheme = schemes.pop()
        bias = self._bias(names)
        if scheme is None:
            return self.backend.dense_linear(_cat([self.tensor(f"{n}.weight") for n in names]), bias)
        fuse = lambda: _fused_tensors(scheme, [self._quant_part(n, scheme) for n in names])  # noqa: E731
        # A fused projection's concatenation is a copy: the layout cache keeps it (a single one is the file's).
        fmt, tensors = cached_layout("fused", fuse) if len(names) > 1 else fuse()
        return self.backend.quantized_linear(fmt, tensors, scheme.group_size, bias)

    def _bias(self, names: list[str]) -> torch.Tensor | None:
        if not any(f"{n}.bias" in self.state for n in names):
            return None
        parts = [self.tensor(f"{n}.bias") if f"{n}.bias" in self.state else None for n in names]
        sizes = [self._out_features(n) for n in names]
        return _cat([p if p is not None else torch.zeros(s, dtype=self.dtype, device=self.device)
                     for p, s in zip(parts, sizes)])

    def _out_features(self, name: str) -> int:
        key = next(k for k in (f"{name}.weight", f"{name}.weight_packed") if k in self.state)
        return self.state[key].shape[0]

    def _quant_part(self, name: str, scheme: LinearScheme) -> dict:
        """One Linear's tensors in the layout its kernel linear takes; zero points unpacked to int8 codes."""
        if scheme.activations:
            if not scheme.symmetric:
                raise ConfigError(f"{name}: asymmetric W8A8 weights are not supported")
            return {"weight": self.tensor(f"{name}.weight"), "weight_scale": self.tensor(f"{name}.weight_scale")}
        if scheme.bits == 4:
            part = {"weight_packed": self.tensor(f"{name}.weight_packed"),
                    "weight_scale": self.tensor(f"{name}.weight_scale"),
                    "in_features": int(self.state[f"{name}.weight_shape"][1])}
            if f"{name}.weight_zero_point" in self.state:
                zp = self.state[f"{name}.weight_zero_point"]
                part["zero"] = unpack_zero_point(zp, 4, part["weight_packed"].shape[0]).to(self.device)
            return part
        if scheme.bits == 8:
            q, scale, zp = decompress_linear(self.state, name, scheme)
            part = {"weight": q.to(self.device), "weight_scale": scale.to(self.device)}
            return part if zp is None else {**part, "zero": zp.to(self.device)}
        raise ConfigError(f"{name}: {scheme.bits}-bit weights are not supported (4 and 8 bits only)")


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def _fused_tensors(scheme: LinearScheme, parts: list[dict]) -> tuple[str, dict]:
    """(format, compressed-tensors tensors) of the parts concatenated along the output dimension (same
    scheme, same K), as `Backend.quantized_linear` takes them."""
    if len({p.get("in_features") for p in parts}) > 1:
        raise ArtifactError("fused projections disagree on their input size")
    t = {k: _cat([p[k] for p in parts]) for k in parts[0] if k != "in_features"}
    if scheme.activations:
        return "w8a8", t
    if scheme.bits == 8:
        if "zero" in t:
            t["weight_zero_point"] = t.pop("zero")
        return "w8a16", t
    t["weight_shape"] = torch.tensor([t["weight_packed"].shape[0], parts[0]["in_features"]])
    if "zero" in t:  # packed along the output dim: repack the concatenation
        t["weight_zero_point"] = pack_zero_point(t.pop("zero"), 4)
    return "w4a16", t
