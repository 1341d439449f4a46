"""`run_offline`: the prompts once, the transformers baseline on the first source, then every source in
rounds (--repeats), one fresh engine or model per run."""
from __future__ import annotations

import gc
import statistics

from ..errors import ConfigError
from ..profile.machine import torch_threads
from ..progress import StageHooks
from .baseline import Vocabulary, hf_decode_ms_per_token, hf_throughput, vocabulary
from .config import OfflineConfig
from .engine import EngineRun, decode_ms_per_token, throughput
from .prompts import Prompt, offline_prompts
from .report import Measured, build_report


def run_offline(sources: list[str], config: OfflineConfig, hooks: StageHooks | None = None) -> dict:
    """Measure `sources` side by side (see the package docstring); returns the report."""
    from ..model_io import load_tokenizer
    from ..serve.baseline.hf import model_dir

    hooks = hooks or StageHooks()
    config.validate()
    if not sources:
        raise ConfigError("give --offline SOURCE (repeatable) to run sources through the engine in this process")
    directory = model_dir(sources[0])
    tokenizer = load_tokenizer(directory)
    prompts = offline_prompts(config, tokenizer)
    _check_lengths(prompts, directory, config)
    vocab = vocabulary(directory, tokenizer)
    prompt_tokens = sum(len(p.ids) for p in prompts)
    with torch_threads(config.threads) as threads:
        hooks.status(f"{len(prompts)} prompts, {prompt_tokens} prompt tokens, {config.describe()['mode']}, "
                     f"{config.dtype}, {threads} thread(s)")
        measured = _measure_all(sources, prompts, config, vocab, hooks)
    return build_report(config, measured, prompt_tokens, threads)


def _check_lengths(prompts: list[Prompt], directory, config: OfflineConfig) -> None:
    """Fail before minutes of measuring on a prompt the model cannot take with its new tokens."""
    from ..serve.loader import read_config
    from ..serve.model import spec_from_config

    positions = spec_from_config(read_config(directory)).max_positions
    extra = 1 if config.batch1 else 0  # batch-1 decode times --output-len tokens after the prefill's
    longest = max(prompts, key=lambda p: len(p.ids) + p.output_len)
    if len(longest.ids) + longest.output_len + extra > positions:
        raise ConfigError(f"a prompt of {len(longest.ids)} tokens and {longest.output_len + extra} new tokens passes "
                          f"the model's {positions} positions; lower --input-len or --output-len, or pick shorter prompts")


def _measure_all(sources: list[str], prompts: list[Prompt], config: OfflineConfig, vocab: Vocabulary,
                 hooks: StageHooks) -> list[Measured]:
    """The baseline once (transformers on the first source), then every source in rounds: load on a
    shared machine hits each alike. With --engine hf, the first source's own rows are the baseline."""
    first_is_baseline = config.baseline == "hf" and config.engine == "hf"
    measured = [Measured(s, config.engine, baseline=first_is_baseline and i == 0) for i, s in enumerate(sources)]
    baseline = []
    if config.baseline == "hf" and config.engine == "llmopt":
        baseline = [Measured(sources[0], "hf", baseline=True)]
        baseline[0].runs.append(_measure(baseline[0], prompts, config, vocab, hooks))
    for _ in range(config.repeats):
        for m in measured:
            m.runs.append(_measure(m, prompts, config, vocab, hooks))
    return baseline + measured


def _measure(m: Measured, prompts: list[Prompt], config: OfflineConfig, vocab: Vocabulary, hooks: StageHooks):
    """One run of one engine on one source."""
    gc.collect()
    hooks.status(f"{'llmopt' if m.engine == 'llmopt' else 'transformers'} on {m.source}")
    if config.batch1:
        if m.engine == "llmopt":
            per_prompt, m.spec = decode_ms_per_token(m.source, prompts, config)
        else:
            per_prompt = hf_decode_ms_per_token(m.source, prompts, config)
        hooks.status(f"  {m.source}: {statistics.median(per_prompt):.2f} ms/token")
        return per_prompt
    if m.engine == "llmopt":
        result = throughput(m.source, prompts, config)
    else:
        outputs, seconds = hf_throughput(m.source, prompts, config, vocab, lambda done, s: hooks.status(
            f"  transformers: {done}/{len(prompts)} prompts, {s:.0f} s"))
        result = EngineRun(outputs, seconds, [], [])
    hooks.status(f"  {m.source}: {result.seconds:.1f} s")
    return result
