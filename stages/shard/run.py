"""`llmopt shard SOURCE --tp N -o OUT`: one folder of weights per rank plus the split plan.

Reads the source's safetensors memory-mapped and writes each rank's slices layer by layer, so peak
memory stays near one layer per rank beyond the page cache. Quantized artifacts are split on their
codes (see split.py); a split that would cut a quantization group is refused before anything is written.
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
from .plan import check_row_groups, make_plan, mlp_unit_for, row_split_points
from .split import RankSlicer

WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")
PART_BYTES = 1 << 30  # a rank's weights go to files of about this size


def run_shard(source_ref: str, dest: Path, config: ShardConfig, force: bool = False,
              hooks: StageHooks | None = None) -> Artifact:
    """Split `source_ref` for `config.tp` ranks into a sharded artifact at `dest`."""
    hooks = hooks or StageHooks()
    config.validate()
    dest = Path(dest)
    check_destination(dest, force)
    hooks.status(f"reading {source_ref}")
    source = resolve(str(source_ref))
    parent = as_artifact(source)
    directory = parent.path if parent else source.path
    if parent is not None and parent.tensor_parallel:
        raise ConfigError(f"{source_ref} is already sharded (tp={parent.tensor_parallel['tp']}); shard its parent")
    model_config, family = _read_config(directory)
    state = load_dir(directory, parent.weight_files if parent else weight_files(directory))
    schemes = _schemes(model_config, state)
    plan = _plan(model_config, family, schemes, config.tp)
    start = time.perf_counter()
    with ArtifactWriter(dest, force=force) as w:
        w.check_space(safetensors_bytes(directory))  # the ranks' slices add up to the source (norms repeat)
        _copy_model_files(directory, w.tmp)
        rank_bytes = [_write_rank(w.tmp, RankSlicer(state, schemes, plan, r, family), model_config, hooks)
                      for r in range(config.tp)]
        total = safetensors_bytes(directory)
        model = dict(parent.manifest.get("model", {})) if parent else {}
        model["tensor_parallel"] = plan
        metrics = {"rank_bytes": rank_bytes, "source_bytes": total, "size_bytes": sum(rank_bytes),
                   "rank_share": [round(b / total, 4) for b in rank_bytes] if total else None,
                   "shard_seconds": round(time.perf_counter() - start, 1)}
        for key in ("perplexity", "num_parameters"):  # the model is unchanged: its quality carries over
            if parent and key in parent.manifest.get("metrics", {}):
                metrics[key] = parent.manifest["metrics"][key]
        return w.commit("shard", config.to_dict(), parent, source_record(source, parent), model=model, metrics=metrics)


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


def _write_rank(root: Path, slicer: RankSlicer, config: dict, hooks) -> int:
    rank = slicer.rank["rank"]
    folder = root / rank_dir(rank)
    folder.mkdir()
    state = slicer.state
    writer = ShardWriter(folder, PART_BYTES)  # files of up to PART_BYTES, not one per layer
    writer.add(slicer.vocab("model.embed_tokens"))
    for i in range(int(config["num_hidden_layers"])):
        writer.add(slicer.layer(f"model.layers.{i}"))
    tail = {"model.norm.weight": state["model.norm.weight"]}
    if not config.get("tie_word_embeddings") and any(k.startswith("lm_head.") for k in state):
        tail.update(slicer.vocab("lm_head"))
    writer.add(tail)
    writer.close()
    nbytes = safetensors_bytes(folder)
    hooks.status(f"rank {rank}: {nbytes / 2**20:.1f} MiB")
    return nbytes
