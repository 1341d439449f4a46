"""Perplexity through the serve runtime (`llmopt eval --runtime serve`): each window is one prefill step of
the engine's own runner (paged KV cache, the backend's kernels), with logits for every row, so the figure
measures what `llmopt serve` computes rather than what transformers does with the same weights."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from ..profile.steps import blocks_for, step_input
from ..serve.batch import StepInput


class ServeRuntimeModel:
    """Called as a transformers causal LM (`model(input_ids=[1, S]).logits`), computed by a ModelRunner."""

    def __init__(self, source: str, dtype: torch.dtype | None, seqlen: int, block_size: int = 16):
        from ..model_io import load_tokenizer
        from ..serve.loader import load_runtime, locate
        from ..serve.runner import ModelRunner

        runtime, _, _ = load_runtime(source, dtype=dtype)
        self.tokenizer = load_tokenizer(locate(source)[0])  # transformers' own, as the other runtime tokenizes
        self.runner = ModelRunner(runtime, blocks_for(seqlen, block_size) * runtime.spec.shape.kv.count, block_size)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, use_cache: bool = False):
        ids = input_ids[0]  # [S]
        return SimpleNamespace(logits=self.runner.execute(self._step(ids))[None])  # [1, S, V] fp32

    def _step(self, ids: torch.Tensor) -> StepInput:
        """One sequence's whole prefill (profile's synthetic step, every group's blocks), these tokens, every row's
        logits."""
        s, bs = ids.numel(), self.runner.block_size
        step = step_input([0], [s], bs, blocks_for(s, bs), self.runner.vocab_size, groups=self.runner.kv_groups.count)
        return dataclasses.replace(step, token_ids=ids.long(), logits_indices=torch.arange(s))
