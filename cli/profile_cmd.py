"""llmopt profile SOURCE [SOURCE ...]: latency, roofline, per-layer/op time, memory and capacity on
the serve engine's code path, as tables, --json FILE and a self-contained --html FILE; or, instead of
that sweep, where a serving process's memory goes (--memory), the memory soak (--soak N), one decode
step's matmuls (--kernels), a synthetic model
(--synthetic SHAPE: the engine, --kernel-speed, --check-greedy, --save-model DIR) or the GPU check's
verdict (--acceptance DIR)."""
from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmopt.stages.profile.config import OPTIONS, QUANTIZE_SCHEMES

from . import profile_view
from .options import Backend, BackendOpt, stage_options
from .ui import note, progress_bar

D = OPTIONS.defaults
Scheme = Enum("Scheme", {name: name for name in QUANTIZE_SCHEMES}, type=str)
Sources = Annotated[Optional[list[str]], typer.Argument(help="Model sources (artifact, HF dir, .gguf, alias) to "
                                                             "compare (none with --synthetic).", show_default=False)]
Ints = Optional[str]


def _opt(name: str, help: str):
    return typer.Option(name, help=help)


def run(sources: Sources = None,
        quick: Annotated[bool, _opt("--quick", "A short sweep (about a minute per source on 2 CPU cores).")] = D.quick,
        json_file: Annotated[Optional[Path], _opt("--json", "Write the full report as JSON to FILE.")] = None,
        html_file: Annotated[Optional[Path], _opt("--html", "Write a self-contained HTML report to FILE.")] = None,
        prompt_lens: Annotated[Ints, _opt("--prompt-lens", "Prefill prompt lengths, e.g. 128,512,2048.")] = D.prompt_lens,
        batch_sizes: Annotated[Ints, _opt("--batch-sizes", "Decode batch sizes (must include 1).")] = D.batch_sizes,
        context_lens: Annotated[Ints, _opt("--context-lens", "Decode contexts at batch 1.")] = D.context_lens,
        decode_context: Annotated[Optional[int], _opt("--decode-context", "Context of the batch sweep.")] = D.decode_context,
        decode_steps: Annotated[Optional[int], _opt("--decode-steps", "Decode steps timed per point.")] = D.decode_steps,
        repeats: Annotated[Optional[int], _opt("--repeats", "Prefill timings per length.")] = D.repeats,
        device: Annotated[str, _opt("--device", "cpu | cuda")] = D.device,
        dtype: Annotated[Optional[str], _opt("--dtype", "auto | fp32 | bf16 | fp16")] = D.dtype,
        backend: BackendOpt = Backend(D.backend),
        enforce_eager: Annotated[bool, _opt("--enforce-eager", "--synthetic on CUDA: no CUDA-graph decode (as "
                                                               "llmopt serve --enforce-eager).")] = D.enforce_eager,
        threads: Annotated[Optional[int], _opt("--threads", "CPU threads (default: the usable CPUs).")] = D.threads,
        memory_budget: Annotated[Optional[str], _opt("--memory-budget", "Planner: 8GiB, or 0.9 of free.")] = D.memory_budget,
        plan_context: Annotated[Optional[int], _opt("--plan-context", "Planner: tokens per sequence.")] = D.plan_context,
        target_tpot_ms: Annotated[Optional[float], _opt("--target-tpot-ms", "Planner: latency target.")] = D.target_tpot_ms,
        soak: Annotated[Optional[int], _opt("--soak", "Instead: N short requests, every fifth aborted; "
                                                      "exit 1 unless every block comes back and RSS stays flat.")] = D.soak,
        soak_in_flight: Annotated[int, _opt("--soak-in-flight", "Soak: requests running at once.")] = D.soak_in_flight,
        max_rss_growth_mib: Annotated[float, _opt("--max-rss-growth-mib", "Soak: RSS growth that fails it.")]
        = D.max_rss_growth_mib,
        kernels: Annotated[bool, _opt("--kernels", "Instead: one decode step's matmuls per weight scheme, "
                                                   "on SOURCE's shapes.")] = D.kernels,
        synthetic: Annotated[Optional[str], _opt("--synthetic", "Instead: the engine on random weights of a "
                                                            "shape: llama3-8b | tiny.")] = D.synthetic,
        layers: Annotated[Optional[int], _opt("--layers", "--kernels / --synthetic: decoder layers.")] = D.layers,
        quantize: Annotated[Optional[Scheme], _opt("--quantize", "--synthetic: RTN-quantize the random layers "
                                                                 "first.")] = D.quantize,
        kernel_speed: Annotated[bool, _opt("--kernel-speed", "--synthetic: instead, the quantized matmuls and paged "
                                                             "attention on its shapes.")] = D.kernel_speed,
        check_greedy: Annotated[bool, _opt("--check-greedy", "--synthetic: instead, greedy tokens against the CPU "
                                                             "fp32 path; exit 1 unless equal but at near-ties.")]
        = D.check_greedy,
        save_model: Annotated[Optional[str], _opt("--save-model", "--synthetic: instead, write the model with a "
                                                                  "chat tokenizer as an artifact at DIR.")]
        = D.save_model,
        acceptance: Annotated[Optional[str], _opt("--acceptance", "Instead: the GPU check's PASS/FAIL table from "
                                                                  "its reports in DIR; exit 1 if a row fails.")]
        = D.acceptance,
        memory: Annotated[bool, _opt("--memory", "Instead: every byte of a serving process of SOURCE, per "
                                                 "category (weights, kernel copies, KV cache, primitives).")] = D.memory,
        max_model_len: Annotated[Optional[int], _opt("--max-model-len", "--memory: as `llmopt serve` (sizes the "
                                                                        "KV cache).")] = D.max_model_len,
        max_num_seqs: Annotated[int, _opt("--max-num-seqs", "--memory, and a pipeline's profile: as `llmopt serve`.")] = D.max_num_seqs,
        kv_cache_memory: Annotated[Optional[str], _opt("--kv-cache-memory", "--memory: as `llmopt serve`.")]
        = D.kv_cache_memory,
        per_layer: Annotated[bool, _opt("--per-layer", "Print every layer's row in the terminal.")] = False) -> None:
    from llmopt.stages.profile.config import ProfileConfig
    from llmopt.stages.profile.html import check_output_path, write_report
    from llmopt.stages.profile.modes import check_sources
    from llmopt.stages.profile.pipeline import pipeline_artifact
    from llmopt.stages.progress import StageHooks

    config = ProfileConfig.from_options(stage_options(locals(), OPTIONS))
    sources = sources or []
    check_output_path(json_file, "--json")
    check_output_path(html_file, "--html")
    check_sources(sources, config)
    if config.mode != "sweep" or pipeline_artifact(sources[0]) is not None:  # a pipeline: its stages instead
        raise typer.Exit(_measure(sources, config, json_file, html_file))
    from llmopt.stages.profile.run import preflight, run_profile

    preflight(sources, config)
    with progress_bar("profile") as update:
        report = run_profile(sources, config, StageHooks(status=note, window=update))
    write_report(report, json_file, html_file)
    profile_view.render(report, per_layer)
    for path in (json_file, html_file):
        if path is not None:
            note(f"wrote {path}")


def _measure(sources: list[str], config, json_file: Optional[Path], html_file: Optional[Path]) -> int:
    """--memory, --soak, --kernels, --synthetic or --acceptance: the exit code (1: the soak, the greedy check or the
    acceptance failed)."""
    from llmopt.stages.errors import ConfigError
    from llmopt.stages.profile.html import write_report
    from llmopt.stages.profile.modes import run_measurement, tables
    from llmopt.stages.progress import StageHooks

    if html_file is not None:
        what = f"--{config.mode}" if config.mode != "sweep" else "a pipeline's profile"
        raise ConfigError(f"--html is the sweep's report; {what} writes --json only")
    if config.task == "save_model":
        report = _save_model(config)
    else:
        report = run_measurement(sources, config, StageHooks(status=note), _quantizer(config))
        profile_view.print_tables(tables(report))
    write_report(report, json_file)
    if json_file is not None:
        note(f"wrote {json_file}")
    return 0 if report.get("passed", True) else 1


def _quantizer(config):
    """--synthetic --quantize: the quantize stage's RTN, which the profile stage may not import itself."""
    if config.quantize is None:
        return None
    from llmopt.stages.synthetic_model import quantize_state

    return quantize_state


def _save_model(config) -> dict:
    """--synthetic SHAPE --save-model DIR: the model written as an artifact; its path and facts."""
    from llmopt.stages.synthetic_model import save_model

    report = save_model(config)
    model = report["model"]
    note(f"wrote {report['path']}: synthetic {config.synthetic}, {model['num_hidden_layers']} layers, "
         f"{model['num_parameters']:,} parameters, {model['dtype']}, vocabulary {model['vocab_size']}")
    return report
