"""Start a sharded artifact's ranks on this node and watch them.

Node 0 runs rank 0 in this process (the engine, and the HTTP server if any) and starts its other
local ranks as `python -m llmopt.stages.serve.tp.worker` processes (a pipeline's: `...serve.pp.worker`); the
other nodes (`--node-rank`
> 0) only start their workers. Ranks meet over torch.distributed's TCP rendezvous at
`--master-addr:--master-port` (torchrun's variables). A monitor thread polls the local workers: if
one exits while the group runs, the failure (naming the rank) goes to every registered callback,
the other local ranks are stopped, and if this process has not exited `HARD_EXIT_S` later it exits
with code 3 — a dead rank never leaves a hung server.
"""
from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from llmopt.kernels.threads import usable_cpus

from ...errors import ConfigError
from ...model_io import DTYPE_NAMES
from ..config import TPOptions
from .runner import RankFailure

HARD_EXIT_S = 10.0
TIMEOUT = datetime.timedelta(minutes=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class RankGroup:
    """This node's share of a tensor-parallel group: the worker processes, rank 0's process group."""

    def __init__(self, artifact_path, tp: int, options: TPOptions, device: str = "cpu", dtype=None,
                 backend: str = "auto", kind: str = "tensor-parallel"):
        """`tp`: the ranks of the whole group (a pipeline's stages times their tensor ranks). `backend`: the kernel
        backend's name, which every rank loads its shard with. `kind`: how messages name the group's ranks."""
        options.validate(tp)
        self.kind = kind
        self.path, self.tp, self.options, self.device, self.dtype = str(artifact_path), tp, options, device, dtype
        self.kernel_backend = backend
        self.port = options.master_port or free_port()
        per_node = tp // options.nnodes
        self.local_ranks = list(range(options.node_rank * per_node, (options.node_rank + 1) * per_node))
        self.backend = "nccl" if device.startswith("cuda") else "gloo"
        self.workers: dict[int, subprocess.Popen] = {}
        self.failure: RankFailure | None = None
        self.runner = None
        self._callbacks: list = []
        self._closing = False

    @property
    def comm_device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def threads_per_rank(self) -> int:
        """The CPUs this process may use (affinity, cgroup quota), shared among the local ranks."""
        return max(1, usable_cpus().count // len(self.local_ranks))

    def start(self) -> "RankGroup":
        """Start the local workers, and join rank 0 to the group when it lives here."""
        for rank in self.local_ranks:
            if rank != 0:
                self.workers[rank] = subprocess.Popen(self._worker_command(rank))
        threading.Thread(target=self._monitor, name="llmopt-tp-monitor", daemon=True).start()
        if 0 in self.local_ranks:
            import torch
            import torch.distributed as dist

            if self.backend == "gloo":
                torch.set_num_threads(self.threads_per_rank())
            dist.init_process_group(self.backend, init_method=f"tcp://{self.options.master_addr}:{self.port}",
                                    rank=0, world_size=self.tp, timeout=TIMEOUT)
        return self

    def _worker_command(self, rank: int) -> list[str]:
        module = "pp" if self.kind == "pipeline-parallel" else "tp"
        cmd = [sys.executable, "-m", f"llmopt.stages.serve.{module}.worker", self.path, "--rank", str(rank),
               "--world-size", str(self.tp), "--master-addr", self.options.master_addr, "--master-port",
               str(self.port), "--device", self._rank_device(rank), "--threads", str(self.threads_per_rank()),
               "--backend", self.kernel_backend]
        return cmd + (["--dtype", DTYPE_NAMES[self.dtype]] if self.dtype else [])

    def _rank_device(self, rank: int) -> str:
        if self.backend != "nccl":
            return self.device
        return f"cuda:{rank % len(self.local_ranks)}"

    def on_failure(self, callback) -> None:
        self._callbacks.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def fail(self, failure: RankFailure) -> None:
        """Record the first failure, tell the callbacks, stop the local workers, arm the hard exit."""
        if self.failure is not None or self._closing:
            return
        self.failure = failure
        print(f"error: {failure}", file=sys.stderr, flush=True)
        for callback in list(self._callbacks):
            try:
                callback(failure)
            except Exception:  # a callback's own trouble must not stop the shutdown
                pass
        self._kill_workers()
        timer = threading.Timer(HARD_EXIT_S, self._hard_exit)
        timer.daemon = True
        timer.start()

    def explain(self, error: BaseException) -> RankFailure:
        """The failure behind a failed collective: the monitor's, if it sees a dead rank within a second."""
        deadline = time.monotonic() + 1.0
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.failure is None:
            self.fail(RankFailure(f"{self.kind} communication failed ({error}); a rank on another node "
                                  f"may have died"))
        return self.failure

    def wait(self) -> int:
        """Worker-only nodes: block until the local workers end; non-zero if any failed."""
        while any(p.poll() is None for p in self.workers.values()) and self.failure is None:
            time.sleep(0.2)
        if self.failure is not None:
            return 1
        return max((p.returncode for p in self.workers.values()), default=0)

    def close(self) -> None:
        """Stop the group: STOP to the workers (via rank 0's runner), reap them, leave the process group."""
        if self._closing:
            return
        if self.runner is not None:
            self.runner.close()
        else:  # rank 0 never got going: the workers wait for nothing
            self._kill_workers()
        self._closing = True
        deadline = time.monotonic() + 10.0
        for p in self.workers.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        import torch.distributed as dist

        if self.failure is None and dist.is_available() and dist.is_initialized():  # a broken group may hang
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group cannot always be torn down cleanly; we are exiting anyway
                pass

    def _monitor(self) -> None:
        """A worker that exits while the group runs fails it; one that exits 0 was stopped by rank 0 (a worker
        returns 0 only at STOP), which is how a node without rank 0 learns that the group is over."""
        while not self._closing and self.failure is None:
            for rank, p in self.workers.items():
                code = p.poll()
                if code is not None and code != 0 and not self._closing:
                    self.fail(RankFailure(f"{self.kind} rank {rank} (pid {p.pid}) {_describe_exit(code)}; "
                                          f"the group cannot continue"))
                    return
            time.sleep(0.1)

    def _kill_workers(self) -> None:
        for p in self.workers.values():
            if p.poll() is None:
                p.kill()

    def _hard_exit(self) -> None:
        print(f"error: {self.failure} (exiting)", file=sys.stderr, flush=True)
        os._exit(3)


def run_worker_node(ref, options: TPOptions, device: str = "cpu", dtype=None, backend: str = "auto") -> int:
    """`llmopt serve SHARDED --node-rank K` (K > 0): run this node's ranks until the group ends."""
    from ..loader import sharded_artifact

    art = sharded_artifact(ref)
    if art is None:
        raise ConfigError(f"--node-rank {options.node_rank}: {ref} is not a sharded artifact (llmopt shard --tp N)")
    kind = "pipeline-parallel" if art.pipeline_parallel else "tensor-parallel"
    group = RankGroup(art.path, art.world_size, options, device, dtype, backend, kind).start()
    try:
        return group.wait()
    finally:
        group.close()
