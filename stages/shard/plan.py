"""The tensor-parallel split plan: which rank holds which heads, MLP channels and vocabulary rows.

Megatron-style: q/k/v and gate/up are column-parallel (a rank holds some output rows; of a fused
qkv_proj or gate_up_proj, its rows of each section), o_proj and down_proj row-parallel (the matching
input columns; partial sums are all-reduced), the embedding and lm_head vocab-parallel, norms replicated.

Query heads need not divide by the rank count (SmolLM2-135M: 9 query heads, 3 KV heads, --tp 4).
Each rank takes a contiguous run of whole query heads, sizes as even as possible, and the KV heads
those query heads read. A KV head read from two ranks is replicated on both. Within a rank the
attention kernels need a uniform group (local query head j reads local KV head j // group): when
a rank's query heads fall unevenly on their KV heads, the rank holds one copy of the KV head per
query head (group 1).

The plan is plain JSON (stored in the sharded artifact's manifest); readers need no code from here.
"""
from __future__ import annotations

import math

from ..errors import ConfigError

STANDARD_GROUP_SIZES = (16, 32, 64, 128, 256)


def even_split(total: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """[start, end) ranges covering `total` in `parts` runs of whole `unit`s, sizes as even as possible
    (the first ranges get the extra unit)."""
    units = total // unit
    base, extra = divmod(units, parts)
    ranges, start = [], 0
    for r in range(parts):
        end = start + (base + (r < extra)) * unit
        ranges.append((start, end))
        start = end
    return ranges


def head_assignment(num_heads: int, num_kv_heads: int, tp: int) -> list[dict]:
    """Per rank: {"q_heads": [...], "kv_heads": [...], "group": n} (global head ids, local order)."""
    if tp > num_heads:
        raise ConfigError(f"--tp {tp} exceeds the model's {num_heads} query heads; every rank needs at least one "
                          f"(choose --tp <= {num_heads})")
    group = num_heads // num_kv_heads
    ranks = []
    for start, end in even_split(num_heads, tp):
        q = list(range(start, end))
        kv_of_q = [h // group for h in q]
        distinct = sorted(set(kv_of_q))
        counts = {kv_of_q.count(k) for k in distinct}
        if len(counts) == 1:  # each local KV head serves the same number of local query heads
            ranks.append({"q_heads": q, "kv_heads": distinct, "group": len(q) // len(distinct)})
        else:
            ranks.append({"q_heads": q, "kv_heads": kv_of_q, "group": 1})
    return ranks


def make_plan(config: dict, tp: int, mlp_unit: int = 1) -> dict:
    """The split plan for an HF config dict. `mlp_unit`: MLP channel ranges are whole multiples of it
    (the largest quantization group of the down projections, so row-parallel splits keep groups whole)."""
    if tp < 1:
        raise ConfigError(f"--tp must be at least 1 (got {tp})")
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    inter, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
    if inter // mlp_unit < tp:
        raise ConfigError(f"--tp {tp}: intermediate_size {inter} has only {inter // mlp_unit} whole groups of "
                          f"{mlp_unit} channels to share out; choose a smaller --tp")
    if vocab < tp:
        raise ConfigError(f"--tp {tp} exceeds the vocabulary size {vocab}")
    ranks = head_assignment(heads, kv_heads, tp)
    for r, (rank, mlp, voc) in enumerate(zip(ranks, even_split(inter, tp, mlp_unit), even_split(vocab, tp))):
        rank.update(rank=r, mlp=list(mlp), vocab=list(voc))
    if inter % mlp_unit:  # the remainder channels go to the last rank
        ranks[-1]["mlp"][1] = inter
    return {"tp": tp, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
            "hidden_size": int(config["hidden_size"]), "intermediate_size": inter, "vocab_size": vocab,
            "ranks": ranks}


def local_config(config: dict, rank: dict, plan: dict) -> dict:
    """The config.json a rank's runtime is built from: its own head, channel and vocabulary counts."""
    local = dict(config)
    local.update(num_attention_heads=len(rank["q_heads"]), num_key_value_heads=len(rank["kv_heads"]),
                 head_dim=plan["head_dim"], intermediate_size=rank["mlp"][1] - rank["mlp"][0],
                 vocab_size=rank["vocab"][1] - rank["vocab"][0])
    return local


def row_split_points(plan: dict, kind: str) -> list[int]:
    """Input-column offsets where the row-parallel layer `kind` (o_proj | down_proj) is cut between ranks."""
    if kind == "o_proj":
        return [r["q_heads"][0] * plan["head_dim"] for r in plan["ranks"][1:]]
    return [r["mlp"][0] for r in plan["ranks"][1:]]


def check_row_groups(name: str, in_features: int, group_size: int, cuts: list[int], tp: int) -> None:
    """Refuse a row-parallel split that would cut a quantization group of Linear `name`."""
    if group_size <= 0 or all(c % group_size == 0 for c in cuts):
        return
    fits = [g for g in STANDARD_GROUP_SIZES if in_features % g == 0 and all(c % g == 0 for c in cuts)]
    hint = (f"quantize with --group-size {' or '.join(map(str, fits))} (or per channel, -1)" if fits
            else "quantize per channel (--group-size -1)")
    raise ConfigError(f"--tp {tp} would cut quantization groups of {name}: its {in_features} inputs split at "
                      f"{', '.join(map(str, cuts))}, not multiples of group size {group_size}; {hint}, "
                      f"or choose another --tp")


def mlp_unit_for(group_sizes: list[int]) -> int:
    """Channel unit for the MLP split: a multiple of every down-projection group size (1 when dense)."""
    unit = 1
    for g in group_sizes:
        if g > 0:
            unit = unit * g // math.gcd(unit, g)
    return unit
