"""Build an LLMEngine for a model source: load the runtime on its backend, size the KV cache, wire the
tokenizer, capture the decode steps in CUDA graphs where they apply (CUDA, triton backend, no
--enforce-eager). The composition root of serving: the engine package itself knows no runtime.
A sharded artifact (`llmopt shard`) starts its tensor-parallel ranks (serve/tp) and runs rank 0 here."""
from __future__ import annotations

import atexit
import ctypes
import dataclasses
import logging
import threading
import time

from .engine.config import EngineConfig
from .engine.engine import LLMEngine
from .startup import StartupReport, phase

log = logging.getLogger("llmopt.serve")

# when none of num_blocks, kv_cache_memory and max_model_len is given
DEFAULT_KV_CACHE_MEMORY = {"cpu": "2GiB", "cuda": "0.8"}
log = logging.getLogger("llmopt.serve")


@dataclasses.dataclass(frozen=True)
class KVCachePlan:
    """How big the KV cache is and which option decided it (`kv_cache_plan`)."""
    num_blocks: int
    block_size: int
    block_bytes: int  # one block over the layers of a KV layer group (all layers: one group), keys and values
    dtype: object  # torch.dtype of the cache
    source: str  # what decided the size, as the start-up line says it
    groups: int = 1  # KV layer groups sharing the blocks (stages/families.py KVGroups)

    @property
    def tokens(self) -> int:
        """Tokens of KV over every layer: a block per group each (windowed groups give theirs back while a
        sequence generates, so more fit then)."""
        return self.num_blocks // self.groups * self.block_size

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def describe(self) -> str:
        """The start-up line: "KV cache: 32,768 tokens (2,048 x 16 seqs, from ...), 768 MiB bf16"."""
        dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(str(self.dtype).removeprefix("torch."),
                                                                              str(self.dtype))
        return f"KV cache: {self.tokens:,} tokens ({self.source}), {self.bytes / 2**20:,.0f} MiB {dtype}"


def build_engine(ref: str, config: EngineConfig, device: str = "cpu", dtype=None, backend: str = "auto",
                 tp_options=None, startup: StartupReport | None = None, defer_warmup: bool = False,
                 tensor_parallel_size: int = 1) -> LLMEngine:
    """An engine serving `ref` (alias, GGUF, HF directory or artifact) on `device`, its kernels from `backend`
    ("auto", "cpu-native", "cpu-torch", "triton", "reference"; see `llmopt.kernels.select_backend`).

    startup: times the phases (see startup.py). defer_warmup: leave the matmul primitives
    (`ModelRunner.prebuild_matmuls`) and the KV cache's residency (`ModelRunner.make_kv_cache_resident`) to
    `warm_up_in_background`, which the caller starts once it is ready (the server is ready a second or more
    sooner; both are done moments later). tensor_parallel_size: ranks to serve an unsharded source on, split
    at load time (`tp/at_load.py`); a sharded artifact runs on its own ranks."""
    from .cuda_graphs import graph_batch_sizes, graphs_apply
    from .loader import load_runtime
    from .runner import ModelRunner
    from .tp.at_load import artifact_for_tp

    with phase(startup, "artifact"):
        sharded = artifact_for_tp(ref, tensor_parallel_size)
    if sharded is not None:
        return _build_tp_engine(sharded, config, device, dtype, backend, tp_options)
    runtime, tokenizer, model_config = load_runtime(ref, device, dtype, backend, startup)
    release_free_heap()
    with phase(startup, "kv_cache"):
        runner = ModelRunner(runtime, kv_cache_plan(config, runtime.spec, runtime).num_blocks, config.block_size,
                             prebuild=not defer_warmup, populate=not defer_warmup)
    with phase(startup, "engine"):
        if not config.enforce_eager and graphs_apply(runtime):
            runner.try_capture_decode_graphs(graph_batch_sizes(config.seqs_per_step))
        proposer = None
        if config.speculative is not None and config.speculative.method == "draft":
            from .speculative import load_draft

            proposer = load_draft(config, runtime, tokenizer, device, dtype, backend,
                                  lambda draft: kv_cache_plan(config, draft.spec, draft, announce=False).num_blocks)
        engine = LLMEngine(runner, tokenizer, config, eos_token_ids=eos_token_ids(model_config, tokenizer),
                           proposer=proposer)
    return engine


def warm_up_in_background(engine: LLMEngine) -> threading.Thread:
    """What `build_engine(defer_warmup=True)` left, in a daemon thread: the KV cache's pages made resident,
    then the matmul primitives built (oneDNN's primitive cache is shared by all threads, so what it builds
    serves the engine's); a log line for each. Both are safe while the engine serves; until they are done a
    step may fault a page in or build a primitive itself. The process waits for the thread at exit (a thread
    still inside torch when the interpreter ends can abort it). Runners without them (tensor-parallel) skip."""
    runner, config = engine.runner, engine.config

    def work() -> None:
        if hasattr(runner, "make_kv_cache_resident"):
            start = time.perf_counter()
            if runner.make_kv_cache_resident():
                log.debug("KV cache resident in %.2f s (in the background)", time.perf_counter() - start)
        if not hasattr(runner, "prebuild_matmuls"):
            return
        start = time.perf_counter()
        runner.prebuild = True
        try:
            calls = runner.prebuild_matmuls(config.max_num_batched_tokens, config.seqs_per_step)
        except Exception as e:  # the primitives are then built as serving meets each shape
            log.warning("matmul prebuild failed (%s: %s); shapes are built as they come", type(e).__name__, e)
            return
        if calls:
            log.info("prebuilt %d matmul shapes in %.2f s (in the background)", calls, time.perf_counter() - start)

    thread = threading.Thread(target=work, name="llmopt-warmup", daemon=True)
    thread.start()
    atexit.register(thread.join)
    return thread


def kv_cache_plan(config: EngineConfig, spec, runtime, announce: bool = True) -> KVCachePlan:
    """The cache's size, from the first of: --num-blocks; --kv-cache-memory (bytes or a fraction of free
    memory); --gpu-memory-utilization (vLLM's: the share of the device's whole memory this process may
    use, the loaded weights included); --max-model-len x --max-num-seqs (vLLM's sizing: every running
    sequence at its longest); the device's default memory. Never more blocks than every running sequence
    at its longest can use.
    announce: log the start-up line that says which rule it was (`KVCachePlan.describe`)."""
    import torch

    from .runner import kv_bytes_per_block, num_kv_blocks, utilization_budget

    dtype, bs = runtime.dtype, config.block_size
    seqs = config.seqs_per_step
    length = config.max_model_len or runtime.spec.max_positions
    # blocks of every running sequence at its longest: a whole prompt's in every KV layer group at admission
    longest = seqs * spec.shape.kv.count * -(-length // bs)
    if config.num_blocks is not None:
        blocks, source = config.num_blocks, "from --num-blocks"
    elif config.kv_cache_memory is not None:
        blocks, source = num_kv_blocks(spec, config.kv_cache_memory, bs, dtype, runtime.device), \
            f"from --kv-cache-memory {config.kv_cache_memory}"
    elif config.gpu_memory_utilization is not None:
        budget, option = utilization_budget(config.gpu_memory_utilization, runtime.device), \
            f"--gpu-memory-utilization {config.gpu_memory_utilization}"
        blocks, source = num_kv_blocks(spec, budget, bs, dtype, runtime.device, option), f"from {option}"
    elif config.max_model_len is not None:
        blocks, source = longest, f"{length:,} x {seqs} seqs, from --max-model-len x --max-num-seqs"
    else:
        memory = DEFAULT_KV_CACHE_MEMORY.get(torch.device(runtime.device).type, "2GiB")
        blocks, source = num_kv_blocks(spec, memory, bs, dtype, runtime.device), \
            f"the default {memory}; size it with --max-model-len or --kv-cache-memory"
    if config.num_blocks is None and blocks > longest:  # memory for nothing
        blocks, source = longest, f"{source}, capped at {length:,} x {seqs} seqs"
    plan = KVCachePlan(blocks, bs, kv_bytes_per_block(spec, bs, dtype), dtype, source, spec.shape.kv.count)
    if announce:
        log.info(plan.describe())
    return plan


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere): loading
    leaves the intermediates of unpacking and packing freed yet resident (45 MB for SmolLM2)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _build_tp_engine(art, config: EngineConfig, device, dtype, backend, tp_options) -> LLMEngine:
    """Rank 0 of a sharded artifact: start the group, load this rank's shard, size the cache for the
    rank holding the most KV heads (every rank allocates the same number of blocks)."""
    from ..errors import ConfigError
    from ..model_io import load_tokenizer
    from .loader import read_config
    from .config import TPOptions
    from .tp.launch import RankGroup
    from .tp.runner import TPModelRunner
    from .tp.runtime import load_rank_runtime, max_local_kv_heads

    plan = art.tensor_parallel
    if config.speculative is not None and config.speculative.method == "draft":
        raise ConfigError("--speculative draft:PATH does not run with a sharded artifact; use ngram")
    if art.pipeline_parallel:
        return _build_pp_engine(art, config, device, dtype, backend, tp_options)
    group = RankGroup(art.path, plan["tp"], tp_options or TPOptions(), device, dtype, backend).start()
    atexit.register(group.close)
    try:
        runtime = load_rank_runtime(art, 0, None, device, dtype, backend)
        widest = dataclasses.replace(runtime.spec, num_kv_heads=max_local_kv_heads(plan))
        runner = TPModelRunner(runtime, kv_cache_plan(config, widest, runtime).num_blocks, config.block_size, group)
    except BaseException:
        group.close()
        raise
    group.runner = runner
    tokenizer = load_tokenizer(art.path)
    return LLMEngine(runner, tokenizer, config, eos_token_ids=eos_token_ids(read_config(art.path), tokenizer))


def _build_pp_engine(art, config: EngineConfig, device, dtype, backend, tp_options) -> LLMEngine:
    """Rank 0 of a pipeline-sharded artifact: start every rank, load stage 0 (tensor rank 0) here, size the
    cache for the stage with the most layers (every stage allocates the same number of blocks)."""
    from ..errors import ConfigError
    from ..model_io import load_tokenizer
    from ..shard.pipeline import stage_config
    from .config import TPOptions
    from .loader import read_config
    from .model import spec_from_config
    from .pp.runner import PipelineRunner
    from .pp.runtime import load_stage_runtime, pipeline_groups
    from .tp.launch import RankGroup
    from .tp.runtime import max_local_kv_heads

    plan, model_config = art.pipeline_parallel, read_config(art.path)
    if config.speculative is not None:
        raise ConfigError("--speculative does not run on a pipeline-parallel artifact yet; serve without it")
    group = RankGroup(art.path, plan["world_size"], tp_options or TPOptions(), device, dtype, backend,
                      kind="pipeline-parallel").start()
    atexit.register(group.close)
    try:
        groups = pipeline_groups(plan)
        runtime = load_stage_runtime(art, 0, groups, device, dtype, backend)
        deepest = max(plan["stages"], key=lambda s: s["layers"][1] - s["layers"][0])
        widest = dataclasses.replace(spec_from_config(stage_config(model_config, deepest)),
                                     num_kv_heads=max_local_kv_heads(art.tensor_parallel))
        blocks = kv_cache_plan(config, widest, runtime).num_blocks
        runner = PipelineRunner(runtime, blocks, config.block_size, group, plan, groups)
    except BaseException:
        group.close()
        raise
    group.runner = runner
    tokenizer = load_tokenizer(art.path)
    return LLMEngine(runner, tokenizer, config, eos_token_ids=eos_token_ids(model_config, tokenizer))


def eos_token_ids(model_config: dict, tokenizer) -> list[int]:
    """Every id that ends a generation: the config's eos_token_id (an int or a list) and the tokenizer's."""
    ids = model_config.get("eos_token_id")
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    ids.append(getattr(tokenizer, "eos_token_id", None))
    return sorted({int(i) for i in ids if i is not None})
