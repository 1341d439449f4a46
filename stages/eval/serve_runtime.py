"""Perplexity through the serve runtime (`llmopt eval --runtime serve`): each window is one prefill step of
the engine's own runner (paged KV cache, the backend's kernels), with logits for every row, so the figure
measures what `llmopt serve` computes rather than what transformers does with the same weights."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ..serve.batch import StepInput


class ServeRuntimeModel:
    """Called as a transformers causal LM (`model(input_ids=[1, S]).logits`), computed by a ModelRunner."""

    def __init__(self, source: str, dtype: torch.dtype | None, seqlen: int, block_size: int = 16):
        from ..model_io import load_tokenizer
        from ..serve.loader import load_runtime, locate
        from ..serve.runner import ModelRunner

        runtime, _, _ = load_runtime(source, dtype=dtype)
        self.tokenizer = load_tokenizer(locate(source)[0])  # transformers' own, as the other runtime tokenizes
        blocks = -(-seqlen // block_size)
        self.runner = ModelRunner(runtime, blocks * runtime.spec.shape.kv.count, block_size)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, use_cache: bool = False):
        ids = input_ids[0]  # [S]
        return SimpleNamespace(logits=self.runner.execute(self._step(ids))[None])  # [1, S, V] fp32

    def _step(self, ids: torch.Tensor) -> StepInput:
        """One sequence's whole prefill over blocks 0.. of each layer group (group g: the g-th run of blocks)."""
        s, bs = ids.numel(), self.runner.block_size
        blocks = -(-s // bs)
        groups = self.runner.kv_groups.count
        tables = [torch.arange(g * blocks, (g + 1) * blocks, dtype=torch.int32)[None] for g in range(groups)]
        slots = [t[0].repeat_interleave(bs)[:s].long() * bs + torch.arange(s) % bs for t in tables]
        return StepInput(token_ids=ids.long(), positions=torch.arange(s), cu_seqlens_q=torch.tensor([0, s], dtype=torch.int32),
                         context_lens=torch.tensor([s], dtype=torch.int32), block_tables=tables[0],
                         slot_mapping=slots[0], max_query_len=s, logits_indices=torch.arange(s),
                         extra_block_tables=tuple(tables[1:]), extra_slot_mappings=tuple(slots[1:]))
