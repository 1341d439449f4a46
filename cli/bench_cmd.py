"""llmopt bench: load-test an OpenAI-compatible server, a running one (--url) or one started for the run (--server),
over HTTP or llmopt's gRPC API (--grpc); or run sources through the engine in this process, without HTTP
(--offline, in bench_offline_cmd.py)."""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmopt.stages.bench.stage import OPTIONS
from llmopt.stages.offline.config import OPTIONS as OFFLINE_OPTIONS

from . import bench_view
from .options import Backend, DType, NumSpeculativeTokens, Speculative, stage_options
from .ui import err, note

D, OD = OPTIONS.defaults, OFFLINE_OPTIONS.defaults
Opt = typer.Option
ServeArgs = Annotated[Optional[list[str]], Opt("--serve-args", help="Options for the started server, one string "
                                                "(repeatable), e.g. --serve-args '--max-num-seqs 32'.")]
FailOn = Annotated[Optional[str], Opt("--fail-on", help="Exit 1 if any holds, comma-separated: p99_ttft_ms>500, output_throughput<50.")]


def run(ctx: typer.Context,
        url: Annotated[Optional[str], Opt("--url", help="Base URL of a running server, e.g. http://127.0.0.1:8000.")] = None,
        server: Annotated[Optional[str], Opt("--server", help="Model source: start a server on it for the run.")] = None,
        grpc: Annotated[Optional[str], Opt("--grpc", metavar="HOST:PORT|auto", help="Bench over gRPC (GenerateStream): "
                                           "HOST:PORT of a running server's gRPC API, or auto with --server.")] = None,
        offline: Annotated[Optional[list[str]], Opt("--offline", help="Model source to run through the engine in this "
                                                    "process, no HTTP (repeatable: side by side).")] = None,
        engine: Annotated[str, Opt("--engine", help="llmopt (llmopt serve / LLMEngine) | hf (transformers baseline).")] = D.engine,
        serve_args: ServeArgs = D.serve_args,
        server_timeout: Annotated[float, Opt("--server-timeout", help="Seconds to wait for the server's /health.")] = D.server_timeout,
        model: Annotated[Optional[str], Opt("--model", help="Model name to send (default: the first the server lists).")] = None,
        endpoint: Annotated[str, Opt("--endpoint", help="completions | chat")] = D.endpoint,
        api_key: Annotated[Optional[str], Opt("--api-key", envvar="LLMOPT_API_KEY", help="Bearer token (as llmopt serve --api-key).")] = None,
        dataset: Annotated[str, Opt("--dataset", "--dataset-name", help="random | sharegpt | sharegpt:FILE | "
                                    "grounded | jsonl:FILE (vLLM's custom) | shared-prefix[:GROUPS,PREFIX_LEN] "
                                    "(SGLang's generated shared prefix; questions of --input-len tokens)")] = D.dataset,
        dataset_path: Annotated[Optional[str], Opt("--dataset-path", help="vLLM's spelling: the file of "
                                                   "--dataset-name (sharegpt, grounded, custom).")] = None,
        num_prompts: Annotated[int, Opt("--num-prompts", min=1)] = D.num_prompts,
        input_len: Annotated[int, Opt("--input-len", "--random-input-len", min=1, help="random: prompt tokens; shared-prefix: question tokens.")] = D.input_len,
        output_len: Annotated[Optional[int], Opt("--output-len", "--random-output-len", min=1, help="max_tokens (default: the reply's length, else 128).")] = D.output_len,
        tokenizer: Annotated[Optional[str], Opt("--tokenizer", help="Model source whose tokenizer counts prompt tokens.")] = D.tokenizer,
        disable_shuffle: Annotated[bool, Opt("--disable-shuffle", help="The first --num-prompts records in file order, unshuffled.")] = D.disable_shuffle,
        request_rate: Annotated[str, Opt("--request-rate", help="Requests per second, or inf (all at once).")] = D.request_rate,
        burstiness: Annotated[float, Opt("--burstiness", help="Gamma shape of arrivals: 1 Poisson, <1 burstier.")] = D.burstiness,
        max_concurrency: Annotated[Optional[int], Opt("--max-concurrency", min=1)] = D.max_concurrency,
        warmup: Annotated[int, Opt("--warmup", min=0, help="Untimed requests first.")] = D.warmup,
        seed: Annotated[int, Opt("--seed")] = D.seed,
        temperature: Annotated[float, Opt("--temperature")] = D.temperature,
        ignore_eos: Annotated[bool, Opt("--ignore-eos", help="Ask the server to generate exactly max_tokens.")] = D.ignore_eos,
        timeout: Annotated[float, Opt("--timeout", help="Per-request read timeout, seconds (gRPC: each call's deadline).")] = D.timeout,
        slo: Annotated[Optional[str], Opt("--slo", help="Goodput SLOs: 'ttft_ms=500,tpot_ms=50,e2e_ms=3000'.")] = D.slo,
        goodput: Annotated[Optional[list[str]], Opt("--goodput", help="vLLM's spelling of --slo: KEY:MS with KEY "
                                                    "ttft, tpot or e2el (repeatable).")] = None,
        fail_on: FailOn = D.fail_on,
        baseline: Annotated[str, Opt("--baseline", help="--offline: hf (transformers generate on the first source) | none.")] = OD.baseline,
        hf_batch_size: Annotated[int, Opt("--hf-batch-size", help="--offline: transformers' static batch size.")] = OD.hf_batch_size,
        dtype: Annotated[DType, Opt("--dtype", help="--offline: both sides' dtype (auto keeps the checkpoint's).")] = DType(OD.dtype),
        device: Annotated[str, Opt("--device", help="--offline: cpu | cuda")] = OD.device,
        backend: Annotated[Backend, Opt("--backend", help="--offline: the engine's kernels, as llmopt serve "
                                        "--backend.")] = Backend(OD.backend),
        threads: Annotated[Optional[int], Opt("--threads", help="--offline: CPU threads (default: the usable CPUs).")] = OD.threads,
        repeats: Annotated[int, Opt("--repeats", help="--offline: runs per source, median reported.")] = OD.repeats,
        speculative: Speculative = OD.speculative, num_speculative_tokens: NumSpeculativeTokens = OD.num_speculative_tokens,
        json: Annotated[Optional[Path], Opt("--json", help="Write the report as JSON to this file.")] = None,
        plot: Annotated[Optional[Path], Opt("--plot", help="Write latency CDFs and throughput to this PNG.")] = None,
        save_result: Annotated[bool, Opt("--save-result", help="vLLM's spelling: write the JSON report to "
                                         "--result-dir/--result-filename.")] = False,
        result_dir: Annotated[Optional[Path], Opt("--result-dir", help="--save-result's folder (default: here).")] = None,
        result_filename: Annotated[Optional[str], Opt("--result-filename", help="--save-result's file name (default: "
                                                      "llmopt-RATEqps-MODEL-TIME.json).")] = None,
        quiet: Annotated[bool, Opt("--quiet", help="No live progress display.")] = False) -> None:
    if ctx.invoked_subcommand:
        return
    from llmopt.stages.bench.config import goodput_as_slo
    from llmopt.stages.bench.dataset import dataset_spec
    from llmopt.stages.bench.stage import BenchStageConfig, check_target
    from llmopt.stages.bench.run import BenchHooks, bench_source, load_bench_requests

    from .bench_offline_cmd import check_mode, run_offline

    check_mode(ctx, offline=bool(offline))
    if offline:
        raise typer.Exit(run_offline(offline, stage_options(locals(), OFFLINE_OPTIONS), json, quiet))
    check_target(url, grpc, server)
    dataset, slo = dataset_spec(dataset, dataset_path), goodput_as_slo(goodput, slo)  # vLLM's spellings
    config = BenchStageConfig.from_options(stage_options(locals(), OPTIONS)).aimed_at(url, model, api_key, grpc)
    with err.status(f"loading tokenizer {tokenizer}") if tokenizer else nullcontext():
        requests = load_bench_requests(config)
    hooks = BenchHooks(status=note, progress=lambda total: bench_view.live_progress(total, quiet))
    saved = (result_dir, result_filename) if save_result else None
    raise typer.Exit(_finish(bench_source(config, requests, server, hooks), json, plot, saved))


def _finish(outcome, json_path: Optional[Path], plot_path: Optional[Path], saved: tuple | None = None) -> int:
    """Show and write the report (also to vLLM's --save-result path, `saved`: folder and file name); the exit
    code: 130 interrupted, 1 a --fail-on bound broken or nothing measured."""
    from llmopt.stages.bench.plot import write_plot
    from llmopt.stages.bench.report import result_path, write_report

    report = outcome.report
    if saved is not None and json_path is None:
        json_path = result_path(report, *saved)
    bench_view.render_report(report)
    for line in bench_view.notes(report):
        note(line)
    for path, write in ((json_path, write_report), (plot_path, write_plot)):
        if path:
            write(report, path)
            note(f"wrote {path}")
    if report["interrupted"]:
        err.print(f"[yellow]interrupted: partial report of {report['completed'] + report['failed']} finished "
                  f"of {report['planned']} requests[/yellow]")
        return 130
    for why in outcome.broken:
        err.print(f"[bold red]fail-on:[/bold red] {why}", highlight=False)
    return 0 if outcome.passed else 1
