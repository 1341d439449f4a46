"""A rank's runtime: the whole-model runtime built from the rank's own config and weights, then
rewired for its group: o_proj and down_proj become row-parallel (all-reduce), the embedding and
lm_head vocab-parallel (see `Runtime.tp`)."""
from __future__ import annotations

import torch

from llmopt.kernels.parallel import RowParallelLinear

from ...artifact import Artifact
from ...safetensors_io import load_dir
from ...shard.plan import local_config
from ..loader import build_runtime, read_config
from ..model import Runtime, TensorParallel


def max_local_kv_heads(plan: dict) -> int:
    """KV heads of the rank that holds the most (the KV cache of every rank has the same block count)."""
    return max(len(r["kv_heads"]) for r in plan["ranks"])


def load_rank_runtime(art: Artifact, rank: int, group, device, dtype=None, backend: str = "auto") -> Runtime:
    """Rank `rank`'s runtime of the sharded artifact `art`, its collectives on `group`, its modules built by
    `backend` (every rank loads with the same name). The row-parallel wrappers have no native form, so a
    backend's fused decode step is not built for a rank."""
    plan = art.tensor_parallel
    rank_plan = plan["ranks"][rank]
    config = local_config(read_config(art.path), rank_plan, plan)
    runtime = build_runtime(config, load_dir(art.path, art.rank_files(rank)), torch.device(device), dtype, backend)
    return split_runtime(runtime, plan, rank, group)


def split_runtime(runtime: Runtime, plan: dict, rank: int, group) -> Runtime:
    """Rewire a runtime built from tensor rank `rank`'s weights for its group: o_proj and down_proj
    row-parallel, the embedding and lm_head vocab-parallel, their collectives on `group` (None: the world)."""
    for layer in runtime.layers:
        layer.o_proj = _row_parallel(layer.o_proj, group)
        layer.down = _row_parallel(layer.down, group)
    sizes = [r["vocab"][1] - r["vocab"][0] for r in plan["ranks"]]
    runtime.tp = TensorParallel(group, rank, plan["ranks"][rank]["vocab"][0], sizes)
    return runtime


def _row_parallel(inner, group) -> RowParallelLinear:
    """The wrapper adds the bias once, after the reduction (the inner linear must not add it per rank)."""
    bias = getattr(inner, "bias", None)
    if bias is not None:
        inner.bias = None
    return RowParallelLinear(inner, group, bias)
