"""Which points of the configured sweep one model can run: lengths within its positions, and a
KV cache (sized for the largest point) within memory. What is left out is said, not silently dropped."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from ..serve.model import ModelSpec
from ..serve.runner import kv_bytes_per_block
from .config import ProfileConfig
from .steps import blocks_for

KV_MEMORY_SHARE = 0.5  # of the memory free after loading: the sweep's cache may take at most this


@dataclass(frozen=True)
class SweepPlan:
    prompt_lens: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    context_lens: tuple[int, ...]
    decode_context: int
    plan_context: int
    num_blocks: int
    skipped: list[str] = field(default_factory=list)


def _within(values, longest: int, what: str, skipped: list[str]) -> tuple[int, ...]:
    kept = tuple(sorted({v for v in values if v <= longest}))
    for v in sorted(set(values) - set(kept)):
        skipped.append(f"{what} {v}: longer than the model's {longest} positions")
    return kept


def _capped(value: int, longest: int, what: str, skipped: list[str]) -> int:
    if value > longest:
        skipped.append(f"{what} {value} lowered to the model's {longest} positions")
    return min(value, longest)


def plan_sweep(config: ProfileConfig, spec: ModelSpec, dtype: torch.dtype, free_bytes: int) -> SweepPlan:
    """The points to measure and the cache blocks they need; ConfigError when nothing fits."""
    longest, bs, skipped = spec.max_positions, config.block_size, []
    prompts = _within(config.prompt_lens, longest, "prompt length", skipped)
    contexts = _within(config.context_lens, longest, "context length", skipped)
    decode_context = _capped(config.decode_context, longest, "--decode-context", skipped)
    plan_context = _capped(config.plan_context, longest, "--plan-context", skipped)
    if not prompts:
        raise ConfigError(f"no --prompt-lens value fits the model's {longest} positions")
    batches = sorted(set(config.batch_sizes))
    limit = int(KV_MEMORY_SHARE * free_bytes) // kv_bytes_per_block(spec, bs, dtype)

    def needed(batch_sizes) -> int:  # a step's tables in every KV layer group (steps.py)
        return spec.shape.kv.count * max(blocks_for(prompts[-1], bs), blocks_for(max(contexts, default=1), bs),
                                         batch_sizes[-1] * blocks_for(decode_context, bs))

    while len(batches) > 1 and needed(batches) > limit:
        skipped.append(f"batch {batches.pop()}: its KV cache at context {decode_context} exceeds "
                       f"{KV_MEMORY_SHARE:.0%} of free memory")
    if needed(batches) > limit:
        raise ConfigError(f"the KV cache for these lengths needs {needed(batches)} blocks, more than "
                          f"{KV_MEMORY_SHARE:.0%} of free memory holds ({limit}); use shorter lengths")
    return SweepPlan(prompts, tuple(batches), contexts, decode_context, plan_context, needed(batches), skipped)
