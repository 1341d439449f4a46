"""Model families as data: one `Family` per architecture, read by the serve runtime, the quantizer's layer
plan, `shard`, `profile` and the native decode step.

A family says how its checkpoint names a decoder layer's tensors and which of the decoder variants it is
(norm placement and kind, q/k norms, gating activation, embedding scale, attention scale); a model's
config.json then gives the sizes and the per-layer attention (`layer_types` / `sliding_window`, one RoPE base
per layer type). `describe(config)` turns both into a `ModelShape` that the code reads instead of asking
which architecture it runs.

To add a family: one `Family(...)` in FAMILIES and a tiny-config test against transformers
(tests/stages/serve/test_families.py); a new variant of a norm, activation or attention is a field here
and the op it needs in the backends.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import ConfigError

# Our names of a layer's norms: input (before attention), mlp (before the MLP), attn_out and mlp_out (Gemma's
# "sandwich" norms on each block's output before the residual add), q and k (per head, before RoPE).
NORM_SLOTS = ("input", "mlp", "attn_out", "mlp_out", "q", "k")
LLAMA_NORMS = {"input": "input_layernorm", "mlp": "post_attention_layernorm"}
LLAMA_PROJECTIONS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "o_proj": ("self_attn.o_proj",),
                     "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class Family:
    """How one architecture's checkpoint and decoder layer look (a row of the table below)."""

    name: str
    architectures: tuple[str, ...]  # config.json `architectures[0]` values
    model_types: tuple[str, ...]  # config.json `model_type` values (when `architectures` is absent)
    # Our fused projections -> the checkpoint's Linears under model.layers.{i}., concatenated in this order
    # (Phi-3 ships q||k||v and gate||up already fused: one name each).
    projections: dict = field(default_factory=lambda: dict(LLAMA_PROJECTIONS), hash=False)
    norms: dict = field(default_factory=lambda: dict(LLAMA_NORMS), hash=False)  # NORM_SLOTS -> checkpoint names
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + w): the weight is stored minus one
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    query_scale_key: str | None = None  # config key s: attention logits scaled by s ** -0.5 (else head_dim)
    activation_keys: tuple[str, ...] = ("hidden_act",)  # where config.json names the gating activation
    default_activation: str = "silu"
    windowed_by_default: bool = True  # a `sliding_window` without `use_sliding_window` applies (not Qwen's)

    @property
    def fused_source(self) -> bool:
        """The checkpoint stores q||k||v (and gate||up) as one Linear."""
        return len(self.projections["qkv"]) == 1

    def layer_linears(self) -> tuple[str, ...]:
        """Every Linear of a decoder layer, by its checkpoint name under model.layers.{i}."""
        return tuple(p for parts in self.projections.values() for p in parts)

    def sections(self) -> dict[str, tuple[str, ...]]:
        """Each Linear of a decoder layer (checkpoint name) -> the sections (SECTIONS) its output rows hold,
        in order: Llama's q_proj holds ("q",), Phi-3's qkv_proj ("q", "k", "v")."""
        out = {}
        for slot, parts in self.projections.items():
            names = SECTIONS[slot]
            out.update({p: (n,) for p, n in zip(parts, names)} if len(parts) == len(names) else {parts[0]: names})
        return out

    def section_rows(self, hidden: int, q_size: int, kv_size: int,
                     intermediate: int) -> dict[str, tuple[str, int, int]]:
        """Each section -> (the Linear holding it, its first output row there, its end row)."""
        shapes, out = section_shapes(hidden, q_size, kv_size, intermediate), {}
        for name, sections in self.sections().items():
            start = 0
            for s in sections:
                out[s] = (name, start, start + shapes[s][0])
                start += shapes[s][0]
        return out

    def linear_shapes(self, hidden: int, q_size: int, kv_size: int, intermediate: int) -> dict[str, tuple[int, int]]:
        """Each Linear of a decoder layer -> (output rows, input columns) of its weight."""
        shapes = section_shapes(hidden, q_size, kv_size, intermediate)
        return {name: (sum(shapes[s][0] for s in sections), shapes[sections[0]][1])
                for name, sections in self.sections().items()}

    def norm_sizes(self, hidden: int, head_dim: int) -> dict[str, int]:
        """Each norm of a decoder layer (checkpoint name) -> its weight's length (q/k norms: one head's)."""
        return {name: head_dim if slot in ("q", "k") else hidden for slot, name in self.norms.items()}


# The sections of a layer's projection slots, in the order of their output rows (a fused Linear holds several).
SECTIONS = {"qkv": ("q", "k", "v"), "o_proj": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


def section_shapes(hidden: int, q_size: int, kv_size: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """Each section -> (output rows, input columns)."""
    return {"q": (q_size, hidden), "k": (kv_size, hidden), "v": (kv_size, hidden), "o": (hidden, q_size),
            "gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}


FAMILIES = (
    Family("llama", ("LlamaForCausalLM",), ("llama",)),
    Family("mistral", ("MistralForCausalLM",), ("mistral",)),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), windowed_by_default=False),  # q/k/v bias: from the weights
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), windowed_by_default=False,
           norms={**LLAMA_NORMS, "q": "self_attn.q_norm", "k": "self_attn.k_norm"}),
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",),
           projections={"qkv": ("self_attn.qkv_proj",), "o_proj": ("self_attn.o_proj",),
                        "gate_up": ("mlp.gate_up_proj",), "down": ("mlp.down_proj",)}),
    Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",),
           norms={"input": "input_layernorm", "attn_out": "post_attention_layernorm",
                  "mlp": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm",
                  "q": "self_attn.q_norm", "k": "self_attn.k_norm"},
           norm_offset=1.0, scale_embeddings=True, query_scale_key="query_pre_attn_scalar",
           activation_keys=("hidden_activation", "hidden_act"), default_activation="gelu_pytorch_tanh"),
)
BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.architectures}
BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def supported_architectures() -> tuple[str, ...]:
    return tuple(BY_ARCHITECTURE)


def family_of(config: dict) -> Family:
    """The Family of a config.json dict; ConfigError naming the supported ones otherwise."""
    archs = config.get("architectures") or []
    family = BY_ARCHITECTURE.get(archs[0]) if archs else BY_MODEL_TYPE.get(config.get("model_type"))
    if family is None:
        name = archs[0] if archs else config.get("model_type")
        raise ConfigError(f"architecture {name} is not supported by the serve runtime; supported: "
                          f"{', '.join(supported_architectures())}")
    return family


@dataclass(frozen=True)
class Rope:
    """One RoPE table: its base and scaling (HF's dict, `rope_type` in it)."""

    theta: float
    scaling: tuple = ()  # sorted (key, value) pairs of the HF scaling dict, hashable

    @property
    def scaling_dict(self) -> dict:
        return dict(self.scaling)


@dataclass(frozen=True)
class LayerAttention:
    """A layer's attention kind: its window (None: the whole context) and its RoPE table."""

    window: int | None
    rope: Rope


@dataclass(frozen=True)
class ModelShape:
    """What the code reads of a model: its family's variant and the config's sizes, per layer where they vary."""

    family: Family
    activation: str  # "silu" | "gelu_tanh"
    attention_scale: float
    embedding_scale: float | None  # None: embeddings as stored
    final_logit_softcap: float | None
    layers: tuple[LayerAttention, ...]  # one per decoder layer

    @property
    def kinds(self) -> tuple[LayerAttention, ...]:
        """The distinct attention kinds, in order of first use."""
        return tuple(dict.fromkeys(self.layers))

    @property
    def kv(self) -> "KVGroups":
        """How the layers share the KV cache's pages (`kv_groups`)."""
        return kv_groups(self.layers)


def describe(config: dict) -> ModelShape:
    """The ModelShape of a config.json dict; ConfigError for what the runtime does not run."""
    family = family_of(config)
    for key in ("attn_logit_softcapping",):
        if config.get(key):
            raise ConfigError(f"{key} = {config[key]} is not supported by the serve runtime (Gemma 2's attention "
                              f"soft-capping; Gemma 3 has none)")
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    query = config.get(family.query_scale_key) if family.query_scale_key else None
    embed = math.sqrt(int(config["hidden_size"])) if family.scale_embeddings else None
    soft = config.get("final_logit_softcapping")
    return ModelShape(family, _activation(family, config), float(query or head_dim) ** -0.5, embed,
                      float(soft) if soft else None, _layers(family, config))


def _activation(family: Family, config: dict) -> str:
    name = next((config[k] for k in family.activation_keys if config.get(k)), family.default_activation)
    if name not in ACTIVATIONS:
        raise ConfigError(f"activation {name!r} is not supported by the serve runtime "
                          f"({', '.join(sorted(ACTIVATIONS))})")
    return ACTIVATIONS[name]


def _layers(family: Family, config: dict) -> tuple[LayerAttention, ...]:
    n = int(config["num_hidden_layers"])
    window = config.get("sliding_window")
    uses_window = bool(window) and config.get("use_sliding_window", family.windowed_by_default) is not False
    types = config.get("layer_types")
    if not types:
        types = ["sliding_attention" if uses_window else "full_attention"] * n
    if len(types) != n:
        raise ConfigError(f"config.json: layer_types has {len(types)} entries for {n} layers")
    out = []
    for kind in types:
        if kind not in ("full_attention", "sliding_attention"):
            raise ConfigError(f"layer type {kind!r} is not supported by the serve runtime "
                              "(full_attention, sliding_attention)")
        sliding = kind == "sliding_attention" and uses_window
        out.append(LayerAttention(int(window) if sliding else None, _rope(config, kind)))
    return tuple(out)


_ROPE_KINDS = ("default", "linear", "llama3")


def _rope(config: dict, layer_type: str) -> Rope:
    """The RoPE of a layer type: transformers 5's `rope_parameters` (flat, or one dict per layer type), or
    transformers 4's `rope_theta` / `rope_scaling` (and Gemma 3's `rope_local_base_freq` for local layers)."""
    params = dict(config.get("rope_parameters") or {})
    per_type = any(isinstance(v, dict) for v in params.values())
    if per_type:  # Gemma 3 under transformers 5: {"full_attention": {...}, "sliding_attention": {...}}
        params = dict(params.get(layer_type) or params.get("full_attention") or {})
    scaling = {**(config.get("rope_scaling") or {}), **params}
    theta = float(scaling.pop("rope_theta", config.get("rope_theta", 10000.0)))
    if layer_type == "sliding_attention" and not per_type and config.get("rope_local_base_freq"):
        theta, scaling = float(config["rope_local_base_freq"]), {}  # transformers 4's Gemma 3 config
    partial = float(scaling.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor") or 1.0)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in _ROPE_KINDS:
        raise ConfigError(f"rope_type {kind!r} is not supported by the serve runtime ({', '.join(_ROPE_KINDS)})")
    if partial != 1.0:
        raise ConfigError(f"partial_rotary_factor {partial} is not supported by the serve runtime (whole heads only)")
    return Rope(theta, tuple(sorted(scaling.items())) if kind != "default" else ())


@dataclass(frozen=True)
class KVGroups:
    """How a model's layers share the paged KV cache's pages (vLLM's hybrid layout): layers of one attention
    kind form groups of `size` layers (size: the largest count that divides every kind's layer count), each
    group with its own block table per sequence over one pool of pages. A page holds a block of `size`
    layers; layer i is slot `slots[i]` of group `groups[i]`. A windowed group gives back the pages that left
    its window, so its layers hold about a window of KV however long a sequence grows. One kind (Llama,
    Mistral): one group of every layer, the cache as [layers, blocks, ...]."""

    size: int
    groups: tuple[int, ...]  # per layer: its group
    slots: tuple[int, ...]  # per layer: its slot in the group's pages
    kinds: tuple[LayerAttention, ...]  # per group: its layers' attention kind

    @property
    def count(self) -> int:
        return len(self.kinds)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(kind.window for kind in self.kinds)


def kv_groups(layers: tuple[LayerAttention, ...]) -> KVGroups:
    """The KVGroups of a model's per-layer attention kinds (`ModelShape.layers`)."""
    kinds = list(dict.fromkeys(layers))
    size = math.gcd(*(layers.count(kind) for kind in kinds))
    seen = {kind: 0 for kind in kinds}
    first = {kind: sum(layers.count(k) for k in kinds[:i]) // size for i, kind in enumerate(kinds)}
    groups, slots = [], []
    for kind in layers:
        groups.append(first[kind] + seen[kind] // size)
        slots.append(seen[kind] % size)
        seen[kind] += 1
    per_group = tuple(kind for kind in kinds for _ in range(layers.count(kind) // size))
    return KVGroups(size, tuple(groups), tuple(slots), per_group)
