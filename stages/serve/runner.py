"""ModelRunner: owns the paged KV cache and runs one StepInput through the runtime.

The cache is allocated once, as one tensor [layers, num_blocks, block_size, 2, Hk, D]: a token's
key and value sit side by side, so the CPU backends write and gather both with one op. Per layer,
`k_caches[l]` and `v_caches[l]` are its [num_blocks, block_size, Hk, D] views with shared
strides, the layout `llmopt.kernels.paged_attention` takes.
Everything device-specific comes from the backend the runtime was loaded with (`runtime.backend`):
each step's attention object, the fused decode step (built once, here) and the matmul prebuild.
Its size is chosen by `build.kv_cache_plan` (--kv-cache-memory, else --max-model-len x --max-num-seqs);
`--kv-cache-memory` is a byte count ("4GiB", "512MB", 1e9) or a fraction of the memory free once the
weights are loaded ("0.5"; CPU: MemAvailable, CUDA: cudaMemGetInfo).
On CUDA the decode steps replay CUDA graphs once `capture_decode_graphs` has captured them (see
`cuda_graphs.py`); every other step, and every step under `--enforce-eager`, runs eagerly.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import time

import torch

from llmopt.kernels import StepMetadata

from ..errors import ConfigError
from .batch import StepInput
from .cuda_graphs import DecodeGraphs, GraphFactory
from .model import ModelSpec, Runtime

log = logging.getLogger("llmopt.serve")

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30,
          "tib": 1 << 40, "b": 1}


def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one cache block takes over the layers of a layer group (all layers where there is one group),
    keys and values."""
    item = torch.empty(0, dtype=dtype).element_size()
    return 2 * spec.shape.kv.size * block_size * spec.num_kv_heads * spec.head_dim * item


def parse_kv_cache_memory(value) -> float | int:
    """A fraction in (0, 1] (float) or a byte count (int) from "0.5", "4GiB", "512MB", 1e9, ..."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        text = repr(value)
    else:
        text = str(value).strip().lower().replace(" ", "")
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([a-z]*)", text)
    if not match or match.group(2) not in _UNITS:
        raise ConfigError(f"--kv-cache-memory {value!r}: give bytes (4GiB, 512MB, 1e9) or a fraction like 0.5")
    number, unit = float(match.group(1)), match.group(2)
    if not unit and 0 < number <= 1:
        return number
    if number * _UNITS[unit] < 1:
        raise ConfigError(f"--kv-cache-memory {value!r} must be positive")
    return int(number * _UNITS[unit])


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for the cache now: CUDA free memory, or the kernel's MemAvailable on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def total_memory_bytes(device: torch.device) -> int:
    """The device's whole memory: the CUDA device's, or the kernel's MemTotal on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def utilization_budget(fraction: float, device) -> int:
    """Bytes left for the cache when this process may use `fraction` of the device's memory (vLLM's
    --gpu-memory-utilization): that share of the total, less what is in use now (the weights are loaded)."""
    total = total_memory_bytes(device)
    return max(0, int(fraction * total) - (total - free_memory_bytes(device)))


def num_kv_blocks(spec: ModelSpec, kv_cache_memory, block_size: int, dtype: torch.dtype, device,
                  option: str | None = None) -> int:
    """How many cache blocks fit the `--kv-cache-memory` budget; ConfigError when not even one does.
    option: the option (and value) that gave `kv_cache_memory`, then a byte count, when not that one."""
    budget = int(kv_cache_memory) if option else parse_kv_cache_memory(kv_cache_memory)
    option = option or f"--kv-cache-memory {kv_cache_memory}"
    if isinstance(budget, float):
        budget = int(budget * free_memory_bytes(device))
    per_block = kv_bytes_per_block(spec, block_size, dtype)
    if budget < per_block:
        raise ConfigError(f"{option}: {budget} bytes hold no cache block "
                          f"({per_block} bytes each with block size {block_size}); give more memory")
    return budget // per_block


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in, writable, without changing its contents


def resident_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                   lazy: bool = False) -> torch.Tensor:
    """A zeroed tensor whose pages are all resident. On CPU: an anonymous mapping (its pages come zeroed)
    that the kernel populates in one call, several times quicker than faulting in and writing each page
    (720 MiB: 0.18 s against 0.4-1.6 s at start-up here). lazy: leave the pages to fault in as first
    touched, or until `make_resident` (the mapping is zeroed either way). Elsewhere, or without
    MAP_POPULATE: empty, then zeroed."""
    import mmap

    populate = getattr(mmap, "MAP_POPULATE", None)
    if torch.device(device).type != "cpu" or populate is None:
        return torch.empty(shape, dtype=dtype, device=device).zero_()
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (0 if lazy else populate)
    region = mmap.mmap(-1, nbytes, flags=flags)
    return torch.frombuffer(region, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


RESIDENT_CHUNK = 64 << 20


def make_resident(tensor: torch.Tensor, chunk: int = RESIDENT_CHUNK) -> bool:
    """Fault a CPU tensor's pages in, writable, keeping what was written (madvise MADV_POPULATE_WRITE,
    no GIL held), `chunk` bytes per call: the call holds the process's memory-map lock, and a thread of
    ours that maps memory meanwhile (malloc, a page fault queued behind it) waits for the call, so one
    call over the whole KV cache stalled start-up's other threads for up to 2 s here (a VM that zeroes fresh
    pages slowly).
    False where the kernel refuses it (the pages then fault in as first touched)."""
    import ctypes
    import mmap

    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or nbytes == 0:
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    address = tensor.data_ptr()
    first = address - address % mmap.PAGESIZE
    end = address + nbytes
    for at in range(first, end, chunk):
        if libc.madvise(at, min(chunk, end - at), _MADV_POPULATE_WRITE) != 0:
            log.debug("madvise(MADV_POPULATE_WRITE) refused (%s); pages fault in as first touched",
                      os.strerror(ctypes.get_errno()))
            return False
    return True


class ModelRunner:
    """Runs StepInputs on a Runtime over a paged KV cache it owns, with the runtime's backend.

    prebuild: whether `prebuild_matmuls` builds the backend's per-shape matmul primitives (CPU: oneDNN's,
    seconds for SmolLM2, tens for an 8B model); without it memory grows as serving meets new batch sizes.
    populate: make the CPU cache's pages resident now; without it they fault in as first used, or with
    `make_kv_cache_resident` (start-up defers it until the server is ready).
    """

    def __init__(self, runtime: Runtime, num_blocks: int, block_size: int = 16, kv_dtype: torch.dtype | None = None,
                 prebuild: bool = True, populate: bool = True):
        spec = runtime.spec
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(f"the KV cache needs at least one block of at least one token "
                              f"(got {num_blocks} blocks of {block_size})")
        self.runtime, self.num_blocks, self.block_size = runtime, num_blocks, block_size
        self.backend, self.prebuild = runtime.backend, prebuild
        self.kv_dtype = kv_dtype or runtime.dtype
        # One pool of blocks shared by the layer groups (stages/families.py KVGroups): block b of slot j is
        # layer j's of whichever group holds b. One group (most models): slot j is layer j.
        self.kv_groups = spec.shape.kv
        shape = (self.kv_groups.size, num_blocks, block_size, 2, spec.num_kv_heads, spec.head_dim)
        # Zeroed, not left empty: padded gathers may read never-written slots, and 0 * NaN would leak.
        # Resident from the start, not lazily mapped (torch.zeros' calloc): RSS does not creep up as
        # serving reaches blocks for the first time, and no step pays those page faults.
        self.kv_cache = resident_zeros(shape, self.kv_dtype, runtime.device, lazy=not populate)
        self.kv_caches = [self.kv_cache[j] for j in self.kv_groups.slots]  # per layer
        self.k_caches, self.v_caches = [c[:, :, 0] for c in self.kv_caches], [c[:, :, 1] for c in self.kv_caches]
        self.scale = spec.shape.attention_scale
        self.fused_decode = self.backend.fused_decode(runtime.layers)  # None where the backend has none
        self.graphs: DecodeGraphs | None = None  # the captured decode steps, once `capture_decode_graphs` ran

    def make_kv_cache_resident(self) -> bool:
        """Fault the KV cache's pages in (`make_resident`); what was written stays. Safe while serving."""
        return make_resident(self.kv_cache)

    @torch.inference_mode()
    def prebuild_matmuls(self, max_tokens: int, max_seqs: int) -> int:
        """Build the backend's per-shape matmul primitives for every row count a step can bring now (CPU:
        oneDNN's, see `kernels.cpu_linear.prebuild_row_buckets`), so memory does not grow while serving.
        Returns the calls made: 0 with `prebuild=False` or where the backend has nothing to build."""
        if not self.prebuild:
            return 0
        return self.backend.prebuild(self.runtime, max_tokens, max_seqs)

    @torch.inference_mode()
    def capture_decode_graphs(self, sizes: list[int], factory: GraphFactory | None = None) -> DecodeGraphs:
        """Capture the decode forward for each batch size in `sizes` (see `cuda_graphs.graph_batch_sizes`);
        from then on `execute` replays them for the decode steps they fit. factory: None captures CUDA
        graphs (`cuda_graphs.CudaGraphCapture`); tests pass `cuda_graphs.EagerCapture`."""
        if self.fused_decode is not None:
            raise ConfigError(f"the {self.backend.name} backend's fused decode step cannot be captured in graphs")
        if self.kv_groups.count > 1:  # the graphs' static buffers hold one block table per row
            raise ConfigError("CUDA graphs cannot capture a model with several KV layer groups yet; use --enforce-eager")
        cuda = self.kv_cache.device.type == "cuda"
        free = free_memory_bytes(self.kv_cache.device) if cuda else 0
        start = time.perf_counter()
        graphs = DecodeGraphs(self, sizes, factory)
        graphs.capture()
        if cuda:
            torch.cuda.synchronize(self.kv_cache.device)
        used = f", {(free - free_memory_bytes(self.kv_cache.device)) / 2**20:.0f} MiB" if cuda else ""
        log.info("captured %d decode graphs (batch sizes %s) in %.1f s%s", len(graphs.sizes),
                 ", ".join(map(str, graphs.sizes)), time.perf_counter() - start, used)
        self.graphs = graphs
        return graphs

    def try_capture_decode_graphs(self, sizes: list[int], factory: GraphFactory | None = None) -> bool:
        """`capture_decode_graphs`, or, where capture fails (a driver or memory error), one warning and eager
        decode: a server that cannot capture still serves. Returns whether the graphs are in place."""
        try:
            self.capture_decode_graphs(sizes, factory)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as error:  # OutOfMemoryError is a RuntimeError too
            self.graphs = None
            if self.kv_cache.device.type == "cuda":
                torch.cuda.synchronize(self.kv_cache.device)
                torch.cuda.empty_cache()
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            log.warning("CUDA-graph capture failed (%s: %s); decoding eagerly (--enforce-eager skips the attempt)",
                        type(error).__name__, first)
            return False
        return True

    @classmethod
    def with_memory(cls, runtime: Runtime, kv_cache_memory, block_size: int = 16, kv_dtype=None) -> "ModelRunner":
        """A runner whose cache fills `kv_cache_memory` (bytes or a fraction of free memory)."""
        dtype = kv_dtype or runtime.dtype
        blocks = num_kv_blocks(runtime.spec, kv_cache_memory, block_size, dtype, runtime.device)
        return cls(runtime, blocks, block_size, dtype)

    @property
    def vocab_size(self) -> int:
        return self.runtime.vocab_size

    @property
    def kv_windows(self) -> tuple[int | None, ...]:
        """The window of each layer group's attention (None: full); the block manager's `windows`."""
        return self.kv_groups.windows

    @property
    def max_fused_rows(self) -> int | None:
        """The most rows a decode step may have and still run the fused decode step (None: there is none). A
        speculative verify step stays within it, so its rows run the kernels a one-token decode runs."""
        return None if self.fused_decode is None else self.fused_decode.max_rows

    @property
    def max_model_len(self) -> int:
        """Longest sequence the runtime can position (RoPE table, sliding window)."""
        return self.runtime.spec.max_positions

    @torch.inference_mode()
    def execute(self, step: StepInput, fused: bool = True) -> torch.Tensor:
        """fp32 logits [R, vocab] for the rows `step.logits_indices` of the flat batch.

        fused: let the backend's fused decode step or the captured decode graphs take the steps they can
        (False: layer by layer, eagerly: the same kernels in the same order one call each, bit-identical
        to the fused step; what `llmopt profile` times)."""
        bucket = self.graphs.bucket(step) if fused and self.graphs is not None else None
        if bucket is not None:
            hidden, residual, rows = self.graphs.run(step, bucket)
            return self.runtime.compute_logits(hidden, residual, rows)
        step = self.on_device(step)
        x, residual = self.run_layers(step, fused)
        return self.runtime.compute_logits(x, residual, step.logits_indices)

    def run_layers(self, step: StepInput, fused: bool = True, hidden: torch.Tensor | None = None):
        """(hidden, residual) [T, H] after the runtime's layers, for a step already on the device (`on_device`).
        hidden: a later pipeline stage's input (serve/pp), in place of the step's embeddings."""
        attns = self.runtime.attentions(self.backend, self.group_metadata(step), self.scale, self.block_size)
        decode = self.fused_decode if fused else None
        return self.runtime(step.token_ids, attns, self.kv_caches,
                            None if decode is None else lambda h, attns: decode(h, attns, self.kv_cache), hidden)

    def group_metadata(self, step: StepInput) -> list[StepMetadata]:
        """The step's attention metadata of each layer group: its block tables and cache slots."""
        tables = (step.block_tables, *step.extra_block_tables)
        slots = (step.slot_mapping, *step.extra_slot_mappings)
        if len(tables) != self.kv_groups.count:
            raise ValueError(f"the step brings block tables of {len(tables)} layer groups, the model has "
                             f"{self.kv_groups.count}")
        return [StepMetadata(step.positions, step.cu_seqlens_q, step.context_lens, t, s, step.max_query_len)
                for t, s in zip(tables, slots)]

    def on_device(self, step: StepInput) -> StepInput:
        """The step with its tensors on the cache's device."""
        device = self.kv_cache.device
        if step.token_ids.device == device:
            return step
        move = lambda v: v.to(device, non_blocking=True) if torch.is_tensor(v) else v  # noqa: E731
        moved = {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}
        moved = {k: tuple(map(move, v)) if isinstance(v, tuple) else move(v) for k, v in moved.items()}
        return StepInput(**moved)
