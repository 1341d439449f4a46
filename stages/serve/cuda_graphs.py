"""CUDA graphs for decode steps: each step's hundreds of kernel launches replayed as one.

A decode step of an 8B model launches some 300 kernels, and at batch 1 launching them (and the Python
around them) costs more than running them. So, as vLLM and TensorRT-LLM do, the runner captures the
decode forward once per batch-size bucket into a CUDA graph and replays it:

- Buckets (`graph_batch_sizes`): 1, 2, 4, then every multiple of 8, up to the engine's running-batch
  limit (`--max-num-seqs`, capped by `--max-batch-size`) and at most MAX_GRAPH_BATCH, which is always
  a bucket itself. A step of B sequences replays the smallest bucket >= B.
- Static buffers, one set for the largest bucket (a bucket's graph reads their first rows): token ids,
  positions, slots, context lengths, block tables as wide as the longest sequence can need
  (cdiv(max_model_len, block_size)) and the rows whose logits are needed. A replay copies the step into
  them; the rows past B are padding that writes no cache slot (slot -1) and attends to one token of
  block 0 (context length 1), so it reads nothing unset and its output is never used.
- The graph holds the model forward (embedding, layers) up to the hidden state; the final norm and
  lm_head run after it on the rows the engine samples, as in eager mode.
- Capture: each bucket is run once eagerly first (Triton compiles, cuBLAS picks its kernels), then
  captured, largest first, all graphs in one memory pool.

This is sound because every launch of a decode step (the Triton kernels, cuBLAS) picks its grid and
kernel from tensor shapes only, never from tensor values, and none syncs with the host.

The graph object comes from a factory (`CudaGraphCapture` on CUDA; `EagerCapture` for tests on CPU, which
re-runs the recorded forward on the same static buffers), so the bookkeeping is tested without a GPU.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from llmopt.kernels import StepMetadata

from ..errors import ConfigError
from .batch import StepInput

MAX_GRAPH_BATCH = 256  # the largest batch captured; bigger decode steps run eagerly
# What a padding row holds: token 0 at position 0, no cache write, attention over one token of block 0.
PAD = {"token_ids": 0, "positions": 0, "slot_mapping": -1, "context_lens": 1}


def graph_batch_sizes(max_seqs: int, limit: int = MAX_GRAPH_BATCH) -> list[int]:
    """The buckets, ascending: 1, 2, 4, 8, 16, 24, ... below min(max_seqs, limit), then that cap itself."""
    top = min(max_seqs, limit)
    return [s for s in (1, 2, 4, *range(8, top, 8)) if s < top] + [top]


def graphs_apply(runtime) -> bool:
    """Whether decode steps of `runtime` can be captured: on CUDA, with the triton backend (whose launches
    depend on shapes only), in one process (a tensor-parallel rank's collectives stay eager), with one KV layer
    group (the static buffers hold one block table per row)."""
    return (torch.device(runtime.device).type == "cuda" and runtime.backend.name == "triton"
            and runtime.tp is None and runtime.kv_groups.count == 1)


@dataclass
class Graph:
    """A captured forward: `replay()` reruns it and leaves its results in `outputs`, the same tensors each time."""

    replay: Callable[[], None]
    outputs: tuple[torch.Tensor, ...]


class GraphFactory(Protocol):
    def __call__(self, forward: Callable[[], tuple[torch.Tensor, ...]]) -> Graph:
        """Capture `forward` (it reads and writes only static tensors)."""


class CudaGraphCapture:
    """The real factory: a `torch.cuda.CUDAGraph` per forward, every graph in one memory pool."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, forward):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = forward()
        return Graph(graph.replay, tuple(outputs))


class EagerCapture:
    """Stands in for CUDA graphs where there are none (tests): a replay reruns the forward eagerly on the
    same static buffers and copies its results into the outputs of the first run, as a graph replay
    leaves them. `captured` and `replayed` count the forwards it was given and the replays."""

    def __init__(self):
        self.captured = self.replayed = 0

    def __call__(self, forward):
        self.captured += 1
        outputs = tuple(forward())

        def replay():
            self.replayed += 1
            for static, new in zip(outputs, forward()):
                static.copy_(new)

        return Graph(replay, outputs)


class DecodeBuffers:
    """The static inputs of every bucket's graph, sized for the largest; bucket b reads rows [:b]."""

    def __init__(self, rows: int, width: int, device):
        def full(shape, value, dtype):
            return torch.full(shape, value, dtype=dtype, device=device)

        self.token_ids = full((rows,), PAD["token_ids"], torch.int64)
        self.positions = full((rows,), PAD["positions"], torch.int64)
        self.slot_mapping = full((rows,), PAD["slot_mapping"], torch.int64)
        self.context_lens = full((rows,), PAD["context_lens"], torch.int32)
        self.block_tables = full((rows, width), 0, torch.int32)
        self.logits_indices = full((rows,), 0, torch.int64)
        self.cu_seqlens_q = torch.arange(rows + 1, dtype=torch.int32, device=device)  # one token each, always

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(vars(self))

    def metadata(self, rows: int) -> StepMetadata:
        """The decode step of `rows` sequences that these buffers' first rows describe."""
        return StepMetadata(self.positions[:rows], self.cu_seqlens_q[:rows + 1], self.context_lens[:rows],
                            self.block_tables[:rows], self.slot_mapping[:rows], 1)


class DecodeGraphs:
    """One captured decode forward per bucket over a runner's runtime and KV cache (see the module docstring).

    runner: anything with `runtime`, `backend`, `kv_cache`, `scale`, `block_size` and `max_model_len` (a
    ModelRunner); factory: makes the graphs (None: `CudaGraphCapture`).
    """

    def __init__(self, runner, sizes: list[int], factory: GraphFactory | None = None):
        if not sizes or min(sizes) < 1:
            raise ConfigError(f"CUDA graph batch sizes must be positive (got {sizes})")
        self.runner, self.sizes = runner, sorted(set(sizes))
        self.factory = factory if factory is not None else CudaGraphCapture()
        self.width = -(-runner.max_model_len // runner.block_size)  # block-table entries of the longest sequence
        device = runner.kv_cache.device
        self.static = DecodeBuffers(self.sizes[-1], self.width, device)
        # Where a step is assembled before one copy per buffer moves it to the device (the buffers
        # themselves on CPU); pageable memory, so a copy has read it before it returns.
        self.host = self.static if device.type == "cpu" else DecodeBuffers(self.sizes[-1], self.width, "cpu")
        self.graphs: dict[int, Graph] = {}

    def capture(self) -> None:
        """Warm up and capture every bucket, largest first (the smaller ones reuse its pool memory).
        The buffers hold padding only, so neither the warm-up nor the capture writes the cache."""
        for size in reversed(self.sizes):
            forward = self._forward(size)
            forward()
            self.graphs[size] = self.factory(forward)

    def _forward(self, rows: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        r = self.runner
        attns = r.runtime.attentions(r.backend, [self.static.metadata(rows)], r.scale, r.block_size)
        token_ids = self.static.token_ids[:rows]
        return lambda: r.runtime(token_ids, attns, r.kv_caches)  # (hidden, residual) [rows, H]; no fused step

    def bucket(self, step: StepInput) -> int | None:
        """The bucket whose graph runs `step`, or None when it runs eagerly (prefill or mixed, more sequences
        than the largest bucket, a block table wider than the buffers)."""
        b = step.num_seqs
        if not step.is_decode or step.token_ids.shape[0] != b or step.block_tables.shape[1] > self.width:
            return None
        i = bisect.bisect_left(self.sizes, b)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, step: StepInput, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Replay `bucket`'s graph on `step`: (hidden, residual) [bucket, H] and the logits rows [R]."""
        self._load(step, bucket)
        graph = self.graphs[bucket]
        graph.replay()
        hidden, residual = graph.outputs
        return hidden, residual, self.static.logits_indices[:step.logits_indices.shape[0]]

    def _load(self, step: StepInput, bucket: int) -> None:
        """Write the step and its padding rows into the host buffers, then copy them to the static ones."""
        host, b, w, r = self.host, step.num_seqs, step.block_tables.shape[1], step.logits_indices.shape[0]
        for name, pad in PAD.items():
            rows = getattr(host, name)
            rows[:b] = getattr(step, name)
            rows[b:bucket] = pad
        host.block_tables[:bucket] = 0
        host.block_tables[:b, :w] = step.block_tables
        host.logits_indices[:r] = step.logits_indices
        if host is self.static:
            return
        for name in (*PAD, "block_tables"):
            getattr(self.static, name)[:bucket].copy_(getattr(host, name)[:bucket], non_blocking=True)
        self.static.logits_indices[:r].copy_(host.logits_indices[:r], non_blocking=True)
