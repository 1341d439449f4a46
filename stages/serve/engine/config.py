"""EngineConfig (how the engine batches and caches) and SamplingParams (how one request samples).

Both are frozen and validated on construction, so an engine never holds an inconsistent one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from ...errors import ConfigError

FINISH_REASONS = ("stop", "length", "abort")
SPECULATIVE_METHODS = ("ngram", "draft")


class RequestRejected(ConfigError):
    """A request that can never be served as asked (too long, empty, bad token ids)."""


class ContextLengthExceeded(RequestRejected):
    """The prompt plus max_tokens (or plus one new token, without max_tokens) passes max_model_len."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates (`--speculative ngram|draft:PATH`, `--num-speculative-tokens K`, or vLLM's
    `--speculative-config` JSON: method, model, num_speculative_tokens, prompt_lookup_min/max)."""

    method: str = "ngram"  # ngram | draft
    num_speculative_tokens: int = 4  # K: drafts per verify step (at most; each sequence adapts its own)
    model: str | None = None  # draft: the draft model's source (same tokenizer and vocabulary as the target)
    prompt_lookup_min: int = 1  # ngram: the shortest suffix matched
    prompt_lookup_max: int = 3  # ngram: the longest suffix matched (tried first)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"--speculative {self.method!r}: use ngram or draft:PATH")
        if self.method == "draft" and not self.model:
            raise ConfigError("--speculative draft needs the draft model: draft:PATH")
        if self.method == "ngram" and self.model:
            raise ConfigError("--speculative ngram takes no model (draft:PATH uses one)")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ConfigError(f"--num-speculative-tokens must be between 1 and 16 (got {k!r})")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min ({self.prompt_lookup_min}) and prompt_lookup_max "
                              f"({self.prompt_lookup_max}) must satisfy 1 <= min <= max")

    def describe(self) -> str:
        what = "n-gram lookup" if self.method == "ngram" else f"draft model {self.model}"
        return f"{what}, up to {self.num_speculative_tokens} tokens per step"


_VLLM_METHODS = {"ngram": "ngram", "draft_model": "draft", "draft": "draft"}
_VLLM_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def speculative_config(spec: str | None, num_tokens: int | None = None,
                       json_config: str | None = None) -> SpeculativeConfig | None:
    """The config of `--speculative ngram|draft:PATH` and `--num-speculative-tokens`, or of vLLM's
    `--speculative-config` JSON (not both); None when neither is given."""
    if spec is not None and json_config is not None:
        raise ConfigError("give --speculative or --speculative-config, not both")
    if json_config is not None:
        return _from_json(json_config, num_tokens)
    if spec is None:
        if num_tokens is not None:
            raise ConfigError("--num-speculative-tokens needs --speculative ngram|draft:PATH")
        return None
    method, _, model = spec.partition(":")
    extra = {} if num_tokens is None else {"num_speculative_tokens": num_tokens}
    return SpeculativeConfig(method.strip(), model=model or None, **extra)


def _from_json(text: str, num_tokens: int | None) -> SpeculativeConfig:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--speculative-config is not JSON ({e})") from None
    if not isinstance(data, dict) or set(data) - set(_VLLM_KEYS):
        raise ConfigError(f"--speculative-config: a JSON object with the keys {', '.join(_VLLM_KEYS)}")
    method = _VLLM_METHODS.get(data.get("method") or ("draft_model" if data.get("model") else "ngram"))
    if method is None:
        raise ConfigError(f"--speculative-config method {data['method']!r}: use ngram or draft_model")
    data = data | {"method": method}
    if num_tokens is not None:
        data["num_speculative_tokens"] = num_tokens
    lookup_max = data.get("prompt_lookup_max", SpeculativeConfig.prompt_lookup_max)
    data.setdefault("prompt_lookup_min", min(SpeculativeConfig.prompt_lookup_min, lookup_max))
    return SpeculativeConfig(**data)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and caches; the defaults here are `llmopt serve`'s (see serve/config.py)."""
    block_size: int = 16  # tokens per KV-cache block
    num_blocks: int | None = None  # KV-cache blocks; None: derived from kv_cache_memory by the loader
    kv_cache_memory: str | float | None = None  # bytes ("4GiB", 1e9) or a fraction of free memory ("0.5")
    gpu_memory_utilization: float | None = None  # vLLM's: share of the device's memory, weights included
    max_num_seqs: int = 64  # sequences in the running batch
    max_num_batched_tokens: int = 2048  # new tokens per step (decodes + prefill chunks)
    max_model_len: int | None = None  # prompt + output tokens; None: the model's context length
    max_batch_size: int | None = None  # the seed's dynamic-batching cap (a further limit on max_num_seqs)
    max_wait_ms: float = 0.0  # an idle engine waits up to this long for a short queue to fill a batch
    enforce_eager: bool = False  # no CUDA graphs: every decode step launches its kernels one by one
    enable_prefix_caching: bool = True
    seed: int = 0  # the engine's generator for requests without their own seed
    speculative: SpeculativeConfig | None = None  # speculative decoding (greedy requests); None: off

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_blocks", "max_model_len",
                     "max_batch_size"):
            if getattr(self, name) is not None:
                _positive("--" + name.replace("_", "-"), getattr(self, name))
        if self.kv_cache_memory is not None:
            from ..runner import parse_kv_cache_memory  # the runner owns the cache and its sizing rules

            parse_kv_cache_memory(self.kv_cache_memory)
        if self.gpu_memory_utilization is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                raise ConfigError(f"--gpu-memory-utilization {self.gpu_memory_utilization}: give a fraction in (0, 1]")
            if self.kv_cache_memory is not None:
                raise ConfigError("give --kv-cache-memory or --gpu-memory-utilization, not both")
        if self.max_wait_ms < 0:
            raise ConfigError(f"--max-wait-ms must be >= 0 (got {self.max_wait_ms})")
        if self.max_num_batched_tokens < self.seqs_per_step:
            raise ConfigError(f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least the number "
                              f"of sequences per step ({self.seqs_per_step}) so every running decode fits a step")

    @property
    def seqs_per_step(self) -> int:
        """Running sequences allowed at once: max_num_seqs, capped by max_batch_size."""
        return min(self.max_num_seqs, self.max_batch_size or self.max_num_seqs)

    def resolved(self, num_blocks: int, model_max_len: int, kv_groups: int = 1) -> EngineConfig:
        """This config with num_blocks and max_model_len filled in for a loaded model and cache (kv_groups:
        its KV layer groups, each of which holds a whole prompt's blocks at admission)."""
        capacity = num_blocks // kv_groups * self.block_size
        max_len = self.max_model_len or min(model_max_len, capacity)
        if max_len > capacity:
            raise ConfigError(f"the KV cache holds {capacity} tokens, fewer than --max-model-len {max_len}; "
                              "lower --max-model-len or give the cache more memory (--kv-cache-memory)")
        return replace(self, num_blocks=num_blocks, max_model_len=max_len)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples; the defaults are OpenAI's, as the HTTP API answers."""
    max_tokens: int | None = 16  # None: until max_model_len
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # a private generator: the same tokens whatever else is in the batch
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n: the chosen token's logprob and the top n alternatives
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        if self.max_tokens is not None:
            _positive("max_tokens", self.max_tokens)
        _in_range("temperature", self.temperature, 0.0, None)
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 turns it off; got {self.top_k})")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1] (got {self.top_p})")
        _in_range("min_p", self.min_p, 0.0, 1.0)
        _in_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _in_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty must be > 0 (1 turns it off; got {self.repetition_penalty})")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ConfigError(f"logprobs must be between 0 and 20 (got {self.logprobs})")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer (got {value!r})")


def _in_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ConfigError(f"{name} must be {bounds} (got {value})")
