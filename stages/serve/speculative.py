"""Load the draft model of `--speculative draft:PATH`: its runtime on the target's device and backend, a
KV cache of its own, and the check that it speaks the target's vocabulary (a draft token must mean the same
token to the target). The engine side of speculative decoding is in engine/speculative.py."""
from __future__ import annotations

from ..errors import ConfigError
from .engine.config import EngineConfig
from .engine.draft import DraftProposer


def load_draft(config: EngineConfig, target, tokenizer, device, dtype, backend, num_blocks) -> DraftProposer:
    """The DraftProposer of `config.speculative.model` for the runtime `target` and its tokenizer.
    num_blocks: runtime -> cache blocks (the target's sizing rule, applied to the draft's layers)."""
    from .loader import load_runtime
    from .runner import ModelRunner

    path = config.speculative.model
    runtime, draft_tokenizer, _ = load_runtime(path, device, dtype, backend)
    check_vocabulary(path, runtime.vocab_size, target.vocab_size, draft_tokenizer, tokenizer)
    runner = ModelRunner(runtime, num_blocks(runtime), config.block_size)
    runner.prebuild_matmuls(config.max_num_batched_tokens, config.seqs_per_step)
    return DraftProposer(runner)


def check_vocabulary(path: str, draft_size: int, target_size: int, draft_tokenizer, tokenizer) -> None:
    """ConfigError unless the draft's vocabulary and tokenizer are the target's."""
    if draft_size != target_size or draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"--speculative draft:{path}: its vocabulary ({draft_size} tokens) is not the target's "
                          f"({target_size}); a draft model must share the target's tokenizer")
