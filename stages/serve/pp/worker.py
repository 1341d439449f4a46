"""`python -m llmopt.stages.serve.pp.worker ARTIFACT --rank R ...`: one rank of a pipeline-sharded model, other
than rank 0 (the same command line as a tensor-parallel worker's, tp/worker.py)."""
from __future__ import annotations

import sys

from ..tp.worker import run_rank


def _serve(args, art, comm_device: str) -> int:
    """Join the pipeline's groups (every rank, in the same order), load this rank's stage, run until STOP. It
    leaves without tearing the process group down: the last stage may hold logits nobody collects now."""
    from ...model_io import parse_dtype
    from .runner import stage_loop
    from .runtime import load_stage_runtime, pipeline_groups

    plan = art.pipeline_parallel
    groups = pipeline_groups(plan)
    runtime = load_stage_runtime(art, args.rank, groups, args.device, parse_dtype(args.dtype), args.backend)
    stage_loop(runtime, plan, args.rank, groups, comm_device)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_rank(argv, _serve, "llmopt-pp-worker")


if __name__ == "__main__":
    sys.exit(main())
