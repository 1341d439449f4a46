"""The pipeline-parallel stage plan: which contiguous run of decoder layers each stage holds.

A stage holds whole decoder layers [a, b); stage 0 also holds the embedding, the last stage the final norm and
lm_head. Under --tp M every stage is split for M tensor-parallel ranks by the same TP plan (plan.py), and
global rank g = stage * M + t, t the rank's tensor-parallel index within its stage. A model whose lm_head is
tied to the embedding stores one matrix for both; split over stages, the last stage holds its own copy of the
embedding (vocab-sliced under TP) to compute the logits (`tied_lm_head_duplicated`).

Without --pp-layers the layers are balanced by bytes (codes and scales for a quantized model). `--pp-balance
decode` (the default) weighs what a decode step reads: every layer's weights and the head's (final norm and
lm_head, or the tied copy), but not the embedding, which a step only gathers one row of per token. `memory`
weighs what each stage stores: the embedding counts on stage 0 too, for models whose stages must fit devices.
On smollm2-135m (tied, 30 layers, the head about 8 layers' bytes) decode gives 19/11 and memory 15/15; served
with 16 clients, one core per stage, 19/11 ran at 0.83x one process and 15/15 at 0.79x (docs/shard.md).

Like plan.py's, the plan is plain JSON in the sharded artifact's manifest (`model.pipeline_parallel`).
"""
from __future__ import annotations

import re
from itertools import accumulate

from ..errors import ConfigError
from ..families import describe

LAYER_PREFIX = "model.layers."
EMBED_PREFIX = "model.embed_tokens."
HEAD_PREFIXES = ("model.norm.", "lm_head.")
_RANGE = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


def layer_ranges(text: str) -> list[tuple[int, int]]:
    """The half-open ranges that `--pp-layers` text names: inclusive "0-9,10-19" -> [(0, 10), (10, 20)], a
    single number one layer. The syntax only: `parse_pp_layers` checks the ranges against a model."""
    ranges = []
    for part in text.split(","):
        match = _RANGE.fullmatch(part)
        if match is None:
            raise ConfigError(f"--pp-layers {text}: {part.strip()!r} is not a layer range such as 0-9 or a single "
                              "layer such as 5")
        first, last = int(match[1]), int(match[2] or match[1])
        if last < first:
            raise ConfigError(f"--pp-layers {text}: range {part.strip()} runs backwards")
        ranges.append((first, last + 1))
    return ranges


def parse_pp_layers(text: str, num_layers: int, pp: int | None = None) -> list[tuple[int, int]]:
    """The stages' half-open layer ranges from `--pp-layers` text (inclusive ranges "0-9,10-19,20-29"); they
    must cover layers 0 to num_layers - 1 in order, each exactly once, in `pp` ranges when pp is given."""
    where = f"(the model has {num_layers} layers, 0-{num_layers - 1})"
    try:
        ranges = layer_ranges(text)
    except ConfigError as e:
        raise ConfigError(f"{e} {where}") from None
    end = 0
    for first, last in ranges:
        if first != end:
            problem = f"layer {end} is missing" if first > end else f"layer {first} is listed twice"
            raise ConfigError(f"--pp-layers {text}: {problem}; list every layer once, in order {where}")
        end = last
    if end != num_layers:
        missing = f"layer {end} is" if end == num_layers - 1 else f"layers {end}-{num_layers - 1} are"
        problem = f"{missing} missing" if end < num_layers else f"there is no layer {end - 1}"
        raise ConfigError(f"--pp-layers {text}: {problem} {where}")
    if pp is not None and len(ranges) != pp:
        raise ConfigError(f"--pp-layers {text} lists {len(ranges)} stages but --pp is {pp} {where}")
    return ranges


def balance_layers(layer_bytes: list[int], pp: int, first_bytes: int, last_bytes: int) -> list[tuple[int, int]]:
    """Contiguous, non-empty layer ranges [a, b) for `pp` stages with the largest stage's bytes as small as
    possible, stage 0 also holding `first_bytes` (the embedding) and the last stage `last_bytes` (the head).

    Of the splits with that largest stage, the most even is taken (least sum of squared stage bytes); of those
    still tied, later stages take the extra layers (each boundary as early as it can be, from the last one
    back). Exact: dynamic programming over (stage, layer), O(pp * layers^2)."""
    n = len(layer_bytes)
    if pp < 1:
        raise ConfigError(f"--pp must be a positive integer (got {pp})")
    if pp > n:
        raise ConfigError(f"--pp {pp} exceeds the model's {n} decoder layers; every stage needs at least one "
                          f"(choose --pp <= {n})")
    prefix = list(accumulate(layer_bytes, initial=0))

    def cost(stage: int, a: int, b: int) -> int:
        return prefix[b] - prefix[a] + first_bytes * (stage == 0) + last_bytes * (stage == pp - 1)

    return _most_even(cost, n, pp, _least_largest(cost, n, pp))


def _ends(stage: int, n: int, pp: int) -> range:
    """Where `stage` may end: after its own layer, leaving one for each later stage."""
    return range(stage + 1, n - (pp - 1 - stage) + 1)


def _least_largest(cost, n: int, pp: int) -> int:
    """The smallest largest stage over every split of `n` layers into `pp` runs."""
    best: list[int | None] = [0] + [None] * n  # best[i]: the stages so far covering layers [0, i)
    for stage in range(pp):
        new: list[int | None] = [None] * (n + 1)
        for i in _ends(stage, n, pp):
            new[i] = min(max(best[j], cost(stage, j, i)) for j in range(i) if best[j] is not None)
        best = new
    return best[n]


def _most_even(cost, n: int, pp: int, limit: int) -> list[tuple[int, int]]:
    """The split with no stage over `limit` and the least sum of squared stage bytes (ties: earliest start)."""
    score: list[int | None] = [0] + [None] * n
    starts = []  # per stage: for each end, the start taken
    for stage in range(pp):
        new: list[int | None] = [None] * (n + 1)
        start: list[int | None] = [None] * (n + 1)
        for i in _ends(stage, n, pp):
            for j in range(i):  # ascending, and only a strictly better score replaces: the earliest start wins
                c = cost(stage, j, i)
                if score[j] is not None and c <= limit and (new[i] is None or score[j] + c * c < new[i]):
                    new[i], start[i] = score[j] + c * c, j
        score = new
        starts.append(start)
    ranges, end = [], n
    for stage in reversed(range(pp)):
        ranges.append((starts[stage][end], end))
        end = starts[stage][end]
    return ranges[::-1]


def tied_embeddings(config: dict, names) -> bool:
    """Whether lm_head is the embedding: the config ties them, or the checkpoint (tensor `names`) has no lm_head."""
    return bool(config.get("tie_word_embeddings")) or not any(n.startswith("lm_head.") for n in names)


def stored_bytes(sizes: dict[str, int], num_layers: int, duplicate_embedding: bool) -> tuple[list[int], int, int]:
    """(each decoder layer's bytes, the embedding's, the head's) from each tensor's stored bytes. The head is
    model.norm and lm_head, or with `duplicate_embedding` (a tied model over several stages) model.norm and a
    copy of the embedding."""
    layers, embed, head = [0] * num_layers, 0, 0
    for name, nbytes in sizes.items():
        if name.startswith(LAYER_PREFIX):
            index = int(name[len(LAYER_PREFIX):].split(".", 1)[0])
            if index < num_layers:
                layers[index] += nbytes
        elif name.startswith(EMBED_PREFIX):
            embed += nbytes
        elif name.startswith(HEAD_PREFIXES):
            head += nbytes
    return layers, embed, head + embed * duplicate_embedding


def check_kv_groups(config: dict, pp: int) -> None:
    """Refuse pipeline stages of a model whose layers form several KV groups (Gemma 3's sliding and full ones)."""
    if pp > 1 and describe(config).kv.count > 1:
        raise ConfigError(f"--pp {pp}: this model's layers form several KV layer groups (sliding-window and full "
                          "attention); pipeline stages of such models are not supported yet; use --tp")


BALANCES = ("decode", "memory")  # --pp-balance: bytes a decode step reads, or bytes each stage stores


def plan_stages(config: dict, sizes: dict[str, int], tp: int, pp: int, pp_layers: str | None, tied: bool,
                balance: str = "decode") -> dict:
    """The pipeline plan for a model (`config`, each stored tensor's bytes `sizes`): the stages --pp-layers
    names, else `pp` stages balanced by `balance` (BALANCES: the embedding weighs nothing for decode, a row
    gather per token, and its stored bytes for memory)."""
    if balance not in BALANCES:
        raise ConfigError(f"--pp-balance {balance!r}: use one of {', '.join(BALANCES)}")
    n = int(config["num_hidden_layers"])
    check_kv_groups(config, pp)
    layers, embed, head = stored_bytes(sizes, n, tied and pp > 1)
    if pp_layers is not None:
        ranges = parse_pp_layers(pp_layers, n, pp)
        balance = "explicit"
    else:
        ranges = balance_layers(layers, pp, embed if balance == "memory" else 0, head)
    stage_bytes = [sum(layers[a:b]) + embed * (s == 0) + head * (s == pp - 1) for s, (a, b) in enumerate(ranges)]
    return make_pipeline_plan(config, ranges, tp, stage_bytes, balance, tied=tied)


def make_pipeline_plan(config: dict, ranges: list[tuple[int, int]], tp: int, stage_bytes: list[int], balance: str,
                       tied: bool | None = None) -> dict:
    """The manifest entry `model.pipeline_parallel`: stages `ranges` of `tp` ranks each. `stage_bytes`: each
    stage's weights as stored in the source (all its ranks together, the tied copy included); `balance`: what
    balance_layers weighed ("decode" or "memory", BALANCES) or "explicit" (--pp-layers); `tied`: lm_head is the
    embedding (default: the config's tie_word_embeddings)."""
    pp = len(ranges)
    tied = bool(config.get("tie_word_embeddings")) if tied is None else tied
    stages = [{"stage": s, "layers": [a, b], "embed": s == 0, "head": s == pp - 1,
               "ranks": [s * tp + t for t in range(tp)], "bytes": int(stage_bytes[s])}
              for s, (a, b) in enumerate(ranges)]
    return {"pp": pp, "tp": tp, "world_size": pp * tp, "num_layers": int(config["num_hidden_layers"]),
            "balance": balance, "stages": stages, "tied_lm_head_duplicated": tied and pp > 1}


def stage_config(config: dict, stage: dict) -> dict:
    """The config.json a stage's runtime is built from: its own layer count and layer types, and where it sits
    (`llmopt_stage`). Under --tp, plan.local_config applies on top of it."""
    a, b = stage["layers"]
    local = dict(config, num_hidden_layers=b - a)
    if config.get("layer_types"):
        local["layer_types"] = list(config["layer_types"][a:b])
    local["llmopt_stage"] = {"stage": stage["stage"], "layers": [a, b], "embed": stage["embed"],
                             "head": stage["head"]}
    return local


def stage_of_rank(plan: dict, rank: int) -> dict:
    """The stage (an entry of plan["stages"]) global rank `rank` belongs to."""
    if not 0 <= rank < plan["world_size"]:
        raise ValueError(f"rank {rank} is outside the plan's {plan['world_size']} ranks")
    return plan["stages"][rank // plan["tp"]]


def tp_index(plan: dict, rank: int) -> int:
    """Global rank `rank`'s tensor-parallel index within its stage."""
    return rank % plan["tp"]
