"""llmopt generate SOURCE --prompt TEXT | --input prompts.jsonl --output out.jsonl: offline generation."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from llmopt.stages.serve.config import DEFAULTS, OPTIONS, ServeConfig
from llmopt.stages.serve import generate as gen

from .options import (Backend, BackendOpt, DType, DTypeOpt, Json, NumSpeculativeTokens, Source, Speculative,
                      SpeculativeJson, Threads)
from .ui import err, note, out, print_json, progress_bar

Prompt = Annotated[Optional[str], typer.Option("--prompt", help="One prompt; its text streams to stdout.")]
Input = Annotated[Optional[Path], typer.Option(
    "--input", "-i", help='JSON lines: {"id", "prompt"} or {"id", "messages"}.')]
OutputFile = Annotated[Optional[Path], typer.Option(
    "--output", "-o", help="JSON lines of results, appended; ids already there are skipped (resume).")]
Chat = Annotated[bool, typer.Option("--chat", help="--prompt: wrap it as a user message in the chat template.")]
Stop = Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).")]
KvMemory = Annotated[Optional[str], typer.Option(
    "--kv-cache-memory", help="KV cache: bytes (4GiB) or a fraction of free memory (0.5).")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Per-request seed (reproducible sampling).")]
O = OPTIONS.defaults  # the options that are no config field (--speculative)
P = gen.DEFAULT_PARAMS  # the sampling defaults below are read from it, the engine's from ServeConfig


def run(source: Source, prompt: Prompt = None, input: Input = None, output: OutputFile = None, chat: Chat = False,
        max_tokens: Annotated[int, typer.Option("--max-tokens", min=1)] = P.max_tokens,
        temperature: Annotated[float, typer.Option("--temperature", help="0: greedy.")] = P.temperature,
        top_k: Annotated[int, typer.Option("--top-k", help="0: off.")] = P.top_k,
        top_p: Annotated[float, typer.Option("--top-p")] = P.top_p,
        min_p: Annotated[float, typer.Option("--min-p")] = P.min_p,
        seed: Seed = P.seed,
        presence_penalty: Annotated[float, typer.Option("--presence-penalty")] = P.presence_penalty,
        frequency_penalty: Annotated[float, typer.Option("--frequency-penalty")] = P.frequency_penalty,
        repetition_penalty: Annotated[float, typer.Option("--repetition-penalty")] = P.repetition_penalty,
        stop: Stop = None, ignore_eos: Annotated[bool, typer.Option("--ignore-eos")] = P.ignore_eos,
        max_num_seqs: Annotated[int, typer.Option(
            "--max-num-seqs", min=1, help="--input: sequences at once (--prompt runs one).")] = DEFAULTS.engine.max_num_seqs,
        max_num_batched_tokens: Annotated[int, typer.Option(
            "--max-num-batched-tokens", min=1)] = DEFAULTS.engine.max_num_batched_tokens,
        max_model_len: Annotated[Optional[int], typer.Option("--max-model-len", min=1)] = DEFAULTS.engine.max_model_len,
        kv_cache_memory: KvMemory = DEFAULTS.engine.kv_cache_memory,
        device: Annotated[str, typer.Option("--device", help="cpu | cuda")] = DEFAULTS.device,
        dtype: DTypeOpt = DType(DEFAULTS.dtype), backend: BackendOpt = Backend(DEFAULTS.backend),
        speculative: Speculative = O.speculative, num_speculative_tokens: NumSpeculativeTokens = O.num_speculative_tokens,
        speculative_config: SpeculativeJson = O.speculative_config, threads: Threads = DEFAULTS.threads,
        json: Json = False) -> None:
    from llmopt.stages.errors import ConfigError
    from llmopt.stages.serve.engine.config import SamplingParams

    if (prompt is None) == (input is None) or (input is None) != (output is None):
        raise ConfigError("give either --prompt TEXT, or --input FILE.jsonl with --output FILE.jsonl")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            seed=seed, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                            repetition_penalty=repetition_penalty, stop=tuple(stop or ()), ignore_eos=ignore_eos)
    config = ServeConfig.from_options(dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                           max_model_len=max_model_len, kv_cache_memory=kv_cache_memory,
                                           device=device, dtype=dtype.value, backend=backend.value,
                                           speculative=speculative, num_speculative_tokens=num_speculative_tokens,
                                           speculative_config=speculative_config, threads=threads))
    if prompt is not None:  # one sequence: a cache sized for one (SmolLM2 fp32: 377 MB, not the default 2 GiB)
        config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, max_num_seqs=1))
        record = gen.PromptRecord("prompt", messages=[{"role": "user", "content": prompt}], where="--prompt") if chat \
            else gen.PromptRecord("prompt", prompt, where="--prompt")
        return _one(_load(source, config), record, params)
    records = gen.read_prompts(input)  # bad input fails before the slow load
    if not {r.key for r in records} - gen.completed_ids(output):
        note(f"nothing to do: every id of {input} is already in {output}")
        return
    job = gen.GenerateJob(_load(source, config), records, output, params)
    with progress_bar(f"generate {input.name}") as update:
        report = job.run(on_progress=update)
    if json:
        print_json(vars(report) | {"tokens_per_s": report.tokens_per_s, "acceptance_rate": report.acceptance_rate,
                                   "mean_accepted_length": report.mean_accepted_length})
    else:
        render(report, output)


def _load(source: str, config: ServeConfig):
    from llmopt.kernels.threads import apply_threads, governor_for, usable_cpus
    from llmopt.stages.model_io import parse_dtype
    from llmopt.stages.serve.build import build_engine

    count = apply_threads(usable_cpus(config.threads))  # before the model's first parallel region
    with err.status(f"loading {source}"):
        engine = build_engine(source, config.engine, config.device, parse_dtype(config.dtype), config.backend)
    engine.thread_governor = governor_for(count) if config.device == "cpu" else None
    return engine


def _one(engine, record, params) -> None:
    final = gen.generate_text(engine, gen.prompt_token_ids(record, engine.tokenizer), params,
                              on_delta=lambda d: print(d, end="", flush=True))
    print()
    note(f"{final.finish_reason}: {final.num_prompt_tokens} prompt tokens, {final.num_output_tokens} generated")
    spec = engine.stats().spec
    if spec.num_draft_tokens:
        note(f"speculative: {spec.num_accepted_tokens}/{spec.num_draft_tokens} drafts accepted "
             f"({spec.acceptance_rate:.0%}), {spec.mean_accepted_length:.2f} tokens per verify step")


def render(report, output: Path) -> None:
    table = Table(title=f"generated -> {output}", title_justify="left", show_header=False)
    table.add_row("requests", f"{report.written} written, {report.skipped} already done, {report.total} in the input")
    table.add_row("tokens", f"{report.prompt_tokens:,} prompt, {report.completion_tokens:,} generated")
    table.add_row("time", f"{report.seconds:.1f} s, {report.tokens_per_s:.1f} generated tokens/s")
    if report.acceptance_rate is not None:
        table.add_row("speculative", f"{report.spec_accepted_tokens:,}/{report.spec_draft_tokens:,} drafts accepted "
                      f"({report.acceptance_rate:.0%}), {report.mean_accepted_length:.2f} tokens per verify step")
    out.print(table)
