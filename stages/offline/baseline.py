"""The transformers side, through the baseline's own generate code (stages/serve/baseline/hf.py):
static left-padded batches for throughput, and batch-1 ms per token."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .config import OfflineConfig
from .prompts import Prompt


@dataclass(frozen=True)
class Vocabulary:
    """What both sides share about the tokens: the ids that end a sequence, and the padding id."""

    eos: frozenset[int]
    pad: int


def vocabulary(directory, tokenizer) -> Vocabulary:
    from ..serve.build import eos_token_ids
    from ..serve.loader import read_config

    eos = frozenset(eos_token_ids(read_config(directory), tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    return Vocabulary(eos, pad)


def hf_throughput(source: str, prompts: list[Prompt], config: OfflineConfig, vocab: Vocabulary,
                  progress: Callable[[int, float], None] | None = None) -> tuple[list[list[int]], float]:
    """transformers `generate` over every prompt in static batches of --hf-batch-size: (outputs, seconds)."""
    from ..serve.baseline.hf import generate_batches, load_model, model_dir

    model = load_model(model_dir(source), config.dtype, config.device)
    return generate_batches(model, [p.ids for p in prompts], [p.output_len for p in prompts], config.hf_batch_size,
                            set(vocab.eos), vocab.pad, config.ignore_eos, config.temperature, progress)


def hf_decode_ms_per_token(source: str, prompts: list[Prompt], config: OfflineConfig) -> list[float]:
    """Batch-1 decode through transformers, one figure (ms per token, prefill left out) per prompt."""
    from ..serve.baseline.hf import load_model, model_dir, ms_per_token

    model = load_model(model_dir(source), config.dtype, config.device)
    return ms_per_token(model, [p.ids for p in prompts], [p.output_len for p in prompts])
