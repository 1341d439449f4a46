"""`python -m llmopt.stages.serve.tp.worker ARTIFACT --rank R ...`: one non-zero rank of a sharded model."""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time


def _die_with_parent() -> None:
    """Exit when the process that started us is gone (no orphaned ranks). Polled, not prctl's
    PDEATHSIG: that fires when the parent *thread* ends, and rank 0 starts us from a loader thread."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="llmopt-tp-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmopt-tp-worker")
    parser.add_argument("artifact")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", default="auto", help="kernel backend, as rank 0 loads with")
    args = parser.parse_args(argv)
    _die_with_parent()
    import torch
    import torch.distributed as dist

    from ...artifact import Artifact
    from ...model_io import parse_dtype
    from .launch import TIMEOUT
    from .runner import worker_loop
    from .runtime import load_rank_runtime

    try:
        torch.set_num_threads(args.threads)
        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(args.device)
        dist.init_process_group(backend, init_method=f"tcp://{args.master_addr}:{args.master_port}",
                                rank=args.rank, world_size=args.world_size, timeout=TIMEOUT)
        art = Artifact.open(args.artifact, verify=False)  # rank 0 verified it; each rank reads its own files
        runtime = load_rank_runtime(art, args.rank, None, args.device, parse_dtype(args.dtype), args.backend)
        worker_loop(runtime, args.device, "cuda" if backend == "nccl" else "cpu")
        dist.destroy_process_group()
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one line naming the rank; rank 0's monitor reports the exit
        print(f"error: tensor-parallel rank {args.rank}: {e.__class__.__name__}: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
