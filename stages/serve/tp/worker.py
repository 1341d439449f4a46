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


def parse_args(argv: list[str] | None = None, prog: str = "llmopt-tp-worker") -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("artifact")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", default="auto", help="kernel backend, as rank 0 loads with")
    return parser.parse_args(argv)


def join(args: argparse.Namespace):
    """Watch the parent, set the threads, join the process group; (the artifact, the communication device)."""
    _die_with_parent()
    import torch
    import torch.distributed as dist

    from ...artifact import Artifact
    from .launch import TIMEOUT

    torch.set_num_threads(args.threads)
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(args.device)
    dist.init_process_group(backend, init_method=f"tcp://{args.master_addr}:{args.master_port}",
                            rank=args.rank, world_size=args.world_size, timeout=TIMEOUT)
    art = Artifact.open(args.artifact, verify=False)  # rank 0 verified it; each rank reads its own files
    return art, "cuda" if backend == "nccl" else "cpu"


def run_rank(argv: list[str] | None, serve, prog: str) -> int:
    """A worker process's life: `serve(args, artifact, communication device)` between joining and the end; one
    line naming the rank if anything fails (rank 0's monitor reports the exit)."""
    args = parse_args(argv, prog)
    try:
        art, comm_device = join(args)
        return serve(args, art, comm_device)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        print(f"error: rank {args.rank}: {e.__class__.__name__}: {e}", file=sys.stderr, flush=True)
        return 1


def _serve(args, art, comm_device: str) -> int:
    import torch.distributed as dist

    from ...model_io import parse_dtype
    from .runner import worker_loop
    from .runtime import load_rank_runtime

    runtime = load_rank_runtime(art, args.rank, None, args.device, parse_dtype(args.dtype), args.backend)
    worker_loop(runtime, args.device, comm_device)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_rank(argv, _serve, "llmopt-tp-worker")


if __name__ == "__main__":
    sys.exit(main())
