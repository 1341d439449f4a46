"""Build an LLMEngine for a model source: load the runtime on its backend, size the KV cache, wire the
tokenizer, capture the decode steps in CUDA graphs where they apply (CUDA, triton backend, no
--enforce-eager). The composition root of serving: the engine package itself knows no runtime.
A sharded artifact (`llmopt shard`) starts its tensor-parallel ranks (serve/tp) and runs rank 0 here."""
from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time

from .engine.config import EngineConfig
from .engine.engine import LLMEngine
from .startup import StartupReport, phase

log = logging.getLogger("llmopt.serve")

DEFAULT_KV_CACHE_MEMORY = {"cpu": "2GiB", "cuda": "0.8"}  # when neither num_blocks nor kv_cache_memory is given


def build_engine(ref: str, config: EngineConfig, device: str = "cpu", dtype=None, backend: str = "auto",
                 tp_options=None, startup: StartupReport | None = None, background_prebuild: bool = False) -> LLMEngine:
    """An engine serving `ref` (alias, GGUF, HF directory or artifact) on `device`, its kernels from `backend`
    ("auto", "cpu-native", "cpu-torch", "triton", "reference"; see `llmopt.kernels.select_backend`).

    startup: times the phases (see startup.py). background_prebuild: build the matmul primitives
    (`ModelRunner.prebuild_matmuls`) in a thread of their own, started as the engine is returned, instead of
    before (the server is ready a second or more sooner; the primitives are all built moments later)."""
    from .cuda_graphs import graph_batch_sizes, graphs_apply
    from .loader import load_runtime, sharded_artifact
    from .runner import ModelRunner

    with phase(startup, "artifact"):
        sharded = sharded_artifact(ref)
    if sharded is not None:
        return _build_tp_engine(sharded, config, device, dtype, backend, tp_options)
    runtime, tokenizer, model_config = load_runtime(ref, device, dtype, backend, startup)
    with phase(startup, "kv_cache"):
        runner = ModelRunner(runtime, _num_blocks(config, runtime.spec, runtime), config.block_size,
                             prebuild=not background_prebuild)
    with phase(startup, "engine"):
        if not config.enforce_eager and graphs_apply(runtime):
            runner.try_capture_decode_graphs(graph_batch_sizes(config.seqs_per_step))
        proposer = None
        if config.speculative is not None and config.speculative.method == "draft":
            from .speculative import load_draft

            proposer = load_draft(config, runtime, tokenizer, device, dtype, backend,
                                  lambda draft: _num_blocks(config, draft.spec, draft))
        engine = LLMEngine(runner, tokenizer, config, eos_token_ids=eos_token_ids(model_config, tokenizer),
                           proposer=proposer)
    if background_prebuild:
        _prebuild_in_background(runner, engine.config)
    return engine


def _prebuild_in_background(runner, config: EngineConfig) -> threading.Thread:
    """`runner.prebuild_matmuls` in a daemon thread (oneDNN's primitive cache is shared by all threads, so
    what it builds serves the engine's); one log line when done. The process waits for it at exit (a
    thread still inside torch when the interpreter ends can abort it)."""
    def work() -> None:
        start = time.perf_counter()
        runner.prebuild = True
        try:
            calls = runner.prebuild_matmuls(config.max_num_batched_tokens, config.seqs_per_step)
        except Exception as e:  # the primitives are then built as serving meets each shape
            log.warning("matmul prebuild failed (%s: %s); shapes are built as they come", type(e).__name__, e)
            return
        if calls:
            log.info("prebuilt %d matmul shapes in %.2f s (in the background)", calls, time.perf_counter() - start)

    thread = threading.Thread(target=work, name="llmopt-prebuild", daemon=True)
    thread.start()
    atexit.register(thread.join)
    return thread


def _num_blocks(config: EngineConfig, spec, runtime) -> int:
    import torch

    from .runner import num_kv_blocks

    if config.num_blocks is not None:
        return config.num_blocks
    memory = config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY.get(torch.device(runtime.device).type, "2GiB")
    fits = num_kv_blocks(spec, memory, config.block_size, runtime.dtype, runtime.device)
    # More than every running sequence at its longest can ever use is memory for nothing.
    longest = -(-(config.max_model_len or runtime.spec.max_positions) // config.block_size)
    return min(fits, config.seqs_per_step * longest)


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
    group = RankGroup(art.path, plan["tp"], tp_options or TPOptions(), device, dtype, backend).start()
    atexit.register(group.close)
    try:
        runtime = load_rank_runtime(art, 0, None, device, dtype, backend)
        widest = dataclasses.replace(runtime.spec, num_kv_heads=max_local_kv_heads(plan))
        runner = TPModelRunner(runtime, _num_blocks(config, widest, runtime), config.block_size, group)
    except BaseException:
        group.close()
        raise
    group.runner = runner
    tokenizer = load_tokenizer(art.path)
    return LLMEngine(runner, tokenizer, config, eos_token_ids=eos_token_ids(read_config(art.path), tokenizer))


def eos_token_ids(model_config: dict, tokenizer) -> list[int]:
    """Every id that ends a generation: the config's eos_token_id (an int or a list) and the tokenizer's."""
    ids = model_config.get("eos_token_id")
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    ids.append(getattr(tokenizer, "eos_token_id", None))
    return sorted({int(i) for i in ids if i is not None})
