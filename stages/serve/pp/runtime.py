"""A pipeline rank's runtime: its stage's layers (with the embedding on the first stage, the final norm and
lm_head on the last), built from its own folder, then split for the stage's tensor-parallel group as a
tensor-parallel rank's is (tp/runtime.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...artifact import Artifact
from ...safetensors_io import load_dir
from ...shard.pipeline import stage_config, stage_of_rank, tp_index
from ...shard.plan import local_config
from ..loader import build_runtime, read_config
from ..model import Runtime
from ..tp.runtime import split_runtime


@dataclass
class PipelineGroups:
    """The process groups of a pipeline besides the world: each stage's tensor-parallel group (only when
    tp > 1) and the return path from the last stage to rank 0, a communicator of its own so that rank 0's
    sends down the pipeline never queue behind its receipt of logits (NCCL runs one communicator in order)."""

    stages: dict
    returns: object


def pipeline_groups(plan: dict) -> PipelineGroups:
    """Create the groups; every rank calls this right after joining, in the same order."""
    stages = {s["stage"]: dist.new_group(s["ranks"]) for s in plan["stages"]} if plan["tp"] > 1 else {}
    return PipelineGroups(stages, dist.new_group([0, last_rank(plan)]))


def last_rank(plan: dict) -> int:
    """The rank that sends the logits: the last stage's tensor rank 0."""
    return plan["stages"][-1]["ranks"][0]


def load_stage_runtime(art: Artifact, rank: int, groups: PipelineGroups, device, dtype=None,
                       backend: str = "auto") -> Runtime:
    """Rank `rank`'s runtime of the pipeline-sharded artifact `art`, built by `backend`."""
    plan, tp_plan = art.pipeline_parallel, art.tensor_parallel
    stage, t = stage_of_rank(plan, rank), tp_index(plan, rank)
    config = stage_config(read_config(art.path), stage)
    if tp_plan["tp"] > 1:
        config = local_config(config, tp_plan["ranks"][t], tp_plan)
    runtime = build_runtime(config, load_dir(art.path, art.rank_files(rank)), torch.device(device), dtype, backend)
    if tp_plan["tp"] > 1:
        runtime = split_runtime(runtime, tp_plan, t, groups.stages[stage["stage"]])
    return runtime
