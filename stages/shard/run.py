"""`llmopt shard SOURCE --tp N [--pp M] -o OUT`: one folder of weights per rank plus the split plans.

Reads the source's safetensors memory-mapped and writes each rank's slices layer by layer, so peak
memory stays near one layer per rank beyond the page cache. Quantized artifacts are split on their
codes (see split.py); a split that would cut a quantization group is refused before anything is written.
With --pp, rank g holds stage g // N's layers (pipeline.py), numbered from 0 in its folder, cut for
tensor-parallel index g % N by the same TP plan as every other stage.
"""
from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

from ..artifact import Artifact, ArtifactWriter, check_destination, member_path, rank_dir, safetensors_bytes
from ..compressed import LinearScheme, parse_schemes
from ..errors import ArtifactError, ConfigError
from ..families import Family, describe
from ..safetensors_io import ShardWriter, load_dir, weight_files
from ..source import as_artifact, resolve, source_record
from ..progress import StageHooks
from .config import ShardConfig
from .pipeline import LAYER_PREFIX, plan_stages, stage_of_rank, tied_embeddings, tp_index
from .plan import check_row_groups, make_plan, mlp_unit_for, row_split_points
from .split import RankSlicer

WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")
PART_BYTES = 1 << 30  # a rank's weights go to files of about this size


def run_shard(source_ref: str, dest: Path, config: ShardConfig, force: bool = False,
              hooks: StageHooks | None = None) -> Artifact:
    """Split `source_ref` for `config.pp` stages of `config.tp` ranks into a sharded artifact at `dest`."""
    hooks = hooks or StageHooks()
    config.validate()
    dest = Path(dest)
    check_destination(dest, force)
    hooks.status(f"reading {source_ref}")
    source = resolve(str(source_ref))
    parent = as_artifact(source)
    directory = parent.path if parent else source.path
    if parent is not None and parent.tensor_parallel:
        raise ConfigError(f"{source_ref} is already sharded for {parent.sharding}; shard its parent")
    model_config, family = _read_config(directory)
    state = load_dir(directory, parent.weight_files if parent else weight_files(directory))
    schemes = _schemes(model_config, state)
    plan = _plan(model_config, family, schemes, config.tp)
    tied = tied_embeddings(model_config, state)
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}
    stages = plan_stages(model_config, sizes, config.tp, config.pp, config.pp_layers, tied, config.pp_balance)
    start = time.perf_counter()
    with ArtifactWriter(dest, force=force) as w:
        total = safetensors_bytes(directory)
        w.check_space(max(total, sum(s["bytes"] for s in stages["stages"])))  # norms repeat; a tied copy
        _copy_model_files(directory, w.tmp)
        rank_bytes = [_write_rank(w.tmp, g, RankSlicer(state, schemes, plan, tp_index(stages, g), family),
                                  stage_of_rank(stages, g), tied, hooks)
                      for g in range(stages["world_size"])]
        model = dict(parent.manifest.get("model", {})) if parent else {}
        model["tensor_parallel"] = plan
        if config.pp > 1:
            model["pipeline_parallel"] = stages
        metrics = _metrics(rank_bytes, total, time.perf_counter() - start, parent, stages)
        return w.commit("shard", config.to_dict(), parent, source_record(source, parent), model=model, metrics=metrics)


def _metrics(rank_bytes: list[int], total: int, seconds: float, parent: Artifact | None, stages: dict) -> dict:
    """Each rank's bytes and share of the source's, each stage's bytes (with --pp), the parent's quality."""
    metrics = {"rank_bytes": rank_bytes, "source_bytes": total, "size_bytes": sum(rank_bytes),
               "rank_share": [round(b / total, 4) for b in rank_bytes] if total else None,
               "shard_seconds": round(seconds, 1)}
    if stages["pp"] > 1:
        metrics["stage_bytes"] = [sum(rank_bytes[g] for g in s["ranks"]) for s in stages["stages"]]
    for key in ("perplexity", "num_parameters"):  # the model is unchanged: its quality carries over
        if parent and key in parent.manifest.get("metrics", {}):
            metrics[key] = parent.manifest["metrics"][key]
    return metrics


def _read_config(directory: Path) -> tuple[dict, Family]:
    """(config.json, the model's Family); refuses what the serve runtime would not run (stages/families.py)."""
    import json

    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{directory}/config.json cannot be read ({e})") from None
    try:
        family = describe(config).family
    except ConfigError as e:
        raise ConfigError(f"shard: {e}") from None
    if (config.get("quantization_config") or {}).get("quant_method") == "bitsandbytes":
        raise ConfigError("shard: bitsandbytes artifacts cannot be split; quantize with rtn/gptq/awq/smoothquant")
    return config, family


def _schemes(config: dict, state: dict) -> dict[str, LinearScheme]:
    qconfig = config.get("quantization_config")
    if not qconfig:
        return {}
    names = sorted({k.rsplit(".", 1)[0] for k in state if k.endswith((".weight", ".weight_packed"))})
    return parse_schemes(qconfig, names)


def _plan(config: dict, family: Family, schemes: dict[str, LinearScheme], tp: int) -> dict:
    """The split plan, refused when a row-parallel cut would split a quantization group or an int32 pack."""
    o_proj, down_proj = "." + family.projections["o_proj"][0], "." + family.projections["down"][0]
    down = [s for n, s in schemes.items() if n.endswith(down_proj)]
    plan = make_plan(config, tp, mlp_unit_for([_cut_unit(s, int(config["intermediate_size"])) for s in down]))
    for name, scheme in sorted(schemes.items()):
        if name.endswith((o_proj, down_proj)):
            kind = "o_proj" if name.endswith(o_proj) else "down_proj"
            width = plan["num_heads"] * plan["head_dim"] if kind == "o_proj" else plan["intermediate_size"]
            check_row_groups(name, width, _cut_unit(scheme, width), row_split_points(plan, kind), tp)
    return plan


def _cut_unit(scheme: LinearScheme, in_features: int) -> int:
    """Input columns a row-parallel cut must keep together: the group, and the int32 pack of codes."""
    group = in_features if scheme.group_size == -1 else scheme.group_size
    pack = 1 if scheme.activations else 32 // scheme.bits
    if scheme.group_size == -1:
        return pack
    return group * pack // math.gcd(group, pack)


def _copy_model_files(src: Path, dst: Path) -> None:
    """config.json, tokenizer and generation config, as they are (every rank reads the same ones); a symlink
    that leads out of the source directory is refused, not copied."""
    for p in sorted(src.iterdir()):
        if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES) and p.name != "llmopt.json":
            shutil.copy2(member_path(src, p.name, f"{src}: file"), dst / p.name)


def _write_rank(root: Path, rank: int, slicer: RankSlicer, stage: dict, tied: bool, hooks) -> int:
    """Global rank `rank`'s folder: its stage's layers (numbered from 0), the embedding on the first stage, the
    final norm and lm_head on the last (of a tied model split over stages, a copy of the embedding); its bytes."""
    folder = root / rank_dir(rank)
    folder.mkdir()
    writer = ShardWriter(folder, PART_BYTES)  # files of up to PART_BYTES, not one per layer
    if stage["embed"]:
        writer.add(slicer.vocab("model.embed_tokens"))
    first, end = stage["layers"]
    for i in range(first, end):
        writer.add(_renumber(slicer.layer(f"{LAYER_PREFIX}{i}"), i, i - first))
    if stage["head"]:
        tail = {"model.norm.weight": slicer.state["model.norm.weight"]}
        if not tied:
            tail.update(slicer.vocab("lm_head"))
        elif not stage["embed"]:  # the last stage computes the logits with its own copy
            tail.update(slicer.vocab("model.embed_tokens"))
        writer.add(tail)
    writer.close()
    nbytes = safetensors_bytes(folder)
    where = "" if stage["embed"] and stage["head"] else f" (stage {stage['stage']}, layers {first}-{end - 1})"
    hooks.status(f"rank {rank}{where}: {nbytes / 2**20:.1f} MiB")
    return nbytes


def _renumber(tensors: dict, index: int, local: int) -> dict:
    """Layer `index`'s tensors named as layer `local` (a stage numbers its layers from 0)."""
    if index == local:
        return tensors
    old, new = f"{LAYER_PREFIX}{index}.", f"{LAYER_PREFIX}{local}."
    return {new + name[len(old):]: t for name, t in tensors.items()}
