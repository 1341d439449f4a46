"""The rank-0 runner (broadcasts each step, then runs its own shard) and the workers' loop."""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod

import torch

from ...errors import LlmoptError
from ..batch import StepInput
from ..runner import ModelRunner
from . import comm

HEARTBEAT_S = 20.0  # an idle rank 0 pings the workers, whose wait for the next step would time out


class RankFailure(LlmoptError):
    """A rank of the tensor-parallel group died or its collectives failed."""


class RankLink(ABC):
    """Rank 0's hold on the other ranks of its group, for the runners of both kinds: one sender at a time
    (steps and heartbeats, under `_lock`), a heartbeat while idle, STOP once at close. A subclass sends a
    command to every other rank with `send_command`."""

    what = "group"  # how errors name it

    def _link(self, ranks) -> None:
        self.ranks = ranks
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._closed = False
        threading.Thread(target=self._heartbeat, name="llmopt-rank-heartbeat", daemon=True).start()

    @abstractmethod
    def send_command(self, command: int) -> None:
        """Send `command` (comm.STOP, comm.NOOP) to every other rank of the group."""

    def watch(self, callback) -> None:
        """Call `callback(RankFailure)` (from a monitor thread) when a rank dies."""
        self.ranks.on_failure(callback)

    def close(self) -> None:
        """Tell the other ranks to stop (once); the launcher then reaps them."""
        if not self._lock.acquire(timeout=5.0):  # a step stuck in a collective or a send: the launcher kills them
            self._closed = True
            return
        try:
            if not self._closed and self.ranks.failure is None:
                self.send_command(comm.STOP)
        except RuntimeError:
            self._closed = True  # a rank already gone: the launcher reports it
        finally:
            self._closed = True
            self._lock.release()

    def _check(self) -> None:
        if self.ranks.failure is not None:
            raise self.ranks.failure
        if self._closed:
            raise RankFailure(f"the {self.what} is shut down")

    def _heartbeat(self) -> None:
        """An idle rank 0 pings the other ranks, whose wait for the next step would time out."""
        while not self._closed and self.ranks.failure is None:
            time.sleep(1.0)
            if time.monotonic() - self._last < HEARTBEAT_S or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._closed and self.ranks.failure is None:
                    self.send_command(comm.NOOP)
                    self._last = time.monotonic()
            except RuntimeError:
                return  # the monitor reports the failure
            finally:
                self._lock.release()


class TPModelRunner(RankLink, ModelRunner):
    """ModelRunner on rank 0 of a tensor-parallel group: the engine calls `execute` as usual."""

    what = "tensor-parallel group"

    def __init__(self, runtime, num_blocks: int, block_size: int, ranks, kv_dtype=None):
        ModelRunner.__init__(self, runtime, num_blocks, block_size, kv_dtype)
        self.comm_device = ranks.comm_device
        comm.send_command(comm.INIT, self.comm_device, num_blocks, block_size)
        self._link(ranks)

    def send_command(self, command: int) -> None:
        comm.send_command(command, self.comm_device)

    def execute(self, step: StepInput, fused: bool = True) -> torch.Tensor:
        with self._lock:
            self._check()
            try:
                comm.send_step(step, self.comm_device)
                logits = super().execute(step, fused)
            except RuntimeError as e:  # a collective failed: name the rank if the monitor knows it
                raise self.ranks.explain(e) from e
            self._last = time.monotonic()
            return logits


def worker_loop(runtime, device, comm_device) -> None:
    """Follow rank 0: build the KV cache it sized, then run every step it broadcasts until STOP."""
    command, args = comm.receive(comm_device)
    if command == comm.STOP:
        return
    if command != comm.INIT:
        raise RankFailure(f"protocol error: expected INIT from rank 0, got command {command}")
    num_blocks, block_size = args
    runner = ModelRunner(runtime, num_blocks, block_size)
    while True:
        command, step = comm.receive(comm_device)
        if command == comm.STOP:
            return
        if command == comm.STEP:
            runner.execute(step)  # the logits are gathered on every rank; rank 0 samples them
