"""Build an LLMEngine for a model source: load the runtime, size the KV cache, wire the tokenizer."""
from __future__ import annotations

from .config import EngineConfig
from .engine import LLMEngine

DEFAULT_KV_CACHE_MEMORY = {"cpu": "2GiB", "cuda": "0.8"}  # when neither num_blocks nor kv_cache_memory is given


def build_engine(ref: str, config: EngineConfig, device: str = "cpu", dtype=None,
                 linear_backend: str | None = None) -> LLMEngine:
    """An engine serving `ref` (alias, GGUF, HF directory or artifact) on `device`."""
    import torch

    from ..loader import load_runtime
    from ..runner import ModelRunner, num_kv_blocks

    runtime, tokenizer, model_config = load_runtime(ref, device, dtype, linear_backend)
    num_blocks = config.num_blocks
    if num_blocks is None:
        memory = config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY.get(torch.device(device).type, "2GiB")
        fits = num_kv_blocks(runtime.spec, memory, config.block_size, runtime.dtype, runtime.device)
        # More than every running sequence at its longest can ever use is memory for nothing.
        longest = -(-(config.max_model_len or runtime.spec.max_positions) // config.block_size)
        num_blocks = min(fits, config.seqs_per_step * longest)
    runner = ModelRunner(runtime, num_blocks, config.block_size)
    return LLMEngine(runner, tokenizer, config, eos_token_ids=eos_token_ids(model_config, tokenizer))


def eos_token_ids(model_config: dict, tokenizer) -> list[int]:
    """Every id that ends a generation: the config's eos_token_id (an int or a list) and the tokenizer's."""
    ids = model_config.get("eos_token_id")
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    ids.append(getattr(tokenizer, "eos_token_id", None))
    return sorted({int(i) for i in ids if i is not None})
