"""llmopt bench: load-test an OpenAI-compatible server (or start one); `llmopt bench compare` two reports."""
from __future__ import annotations

import shlex
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import bench_view
from .ui import err, note, out

app = typer.Typer(invoke_without_command=True, add_completion=False, help=(
    "Load-test an OpenAI-compatible server: throughput, TTFT, TPOT, ITL and end-to-end latency."))

Opt = typer.Option
ServeArgs = Annotated[Optional[list[str]], Opt("--serve-args", help="Options for the started server, one string "
                                                "(repeatable), e.g. --serve-args '--max-num-seqs 32'.")]
FailOn = Annotated[Optional[str], Opt("--fail-on", help="Exit 1 if any holds: 'p99_ttft_ms>500,output_throughput<50'.")]


@app.callback()
def run(ctx: typer.Context,
        url: Annotated[Optional[str], Opt("--url", help="Base URL of a running server, e.g. http://127.0.0.1:8000.")] = None,
        server: Annotated[Optional[str], Opt("--server", help="Model source: start a server on it for the run.")] = None,
        engine: Annotated[str, Opt("--engine", help="--server engine: llmopt (llmopt serve) | hf (transformers baseline).")] = "llmopt",
        serve_args: ServeArgs = None,
        server_timeout: Annotated[float, Opt("--server-timeout", help="Seconds to wait for the server's /health.")] = 600.0,
        model: Annotated[Optional[str], Opt("--model", help="Model name to send (default: the first of /v1/models).")] = None,
        endpoint: Annotated[str, Opt("--endpoint", help="completions | chat")] = "completions",
        api_key: Annotated[Optional[str], Opt("--api-key", envvar="LLMOPT_API_KEY", help="Bearer token (as llmopt serve --api-key).")] = None,
        dataset: Annotated[str, Opt("--dataset", help="random | sharegpt | sharegpt:FILE | jsonl:FILE")] = "random",
        num_prompts: Annotated[int, Opt("--num-prompts", min=1)] = 100,
        input_len: Annotated[int, Opt("--input-len", min=1, help="random: prompt tokens.")] = 128,
        output_len: Annotated[Optional[int], Opt("--output-len", min=1, help="max_tokens (default: the reply's length, else 128).")] = None,
        tokenizer: Annotated[Optional[str], Opt("--tokenizer", help="Model source whose tokenizer counts prompt tokens.")] = None,
        request_rate: Annotated[str, Opt("--request-rate", help="Requests per second, or inf (all at once).")] = "inf",
        burstiness: Annotated[float, Opt("--burstiness", help="Gamma shape of arrivals: 1 Poisson, <1 burstier.")] = 1.0,
        max_concurrency: Annotated[Optional[int], Opt("--max-concurrency", min=1)] = None,
        warmup: Annotated[int, Opt("--warmup", min=0, help="Untimed requests first.")] = 1,
        seed: Annotated[int, Opt("--seed")] = 0,
        temperature: Annotated[float, Opt("--temperature")] = 0.0,
        ignore_eos: Annotated[bool, Opt("--ignore-eos", help="Ask the server to generate exactly max_tokens.")] = False,
        timeout: Annotated[float, Opt("--timeout", help="Per-request read timeout, seconds.")] = 600.0,
        slo: Annotated[Optional[str], Opt("--slo", help="Goodput SLOs: 'ttft_ms=500,tpot_ms=50,e2e_ms=3000'.")] = None,
        fail_on: FailOn = None,
        json: Annotated[Optional[Path], Opt("--json", help="Write the report as JSON to this file.")] = None,
        plot: Annotated[Optional[Path], Opt("--plot", help="Write latency CDFs and throughput to this PNG.")] = None,
        quiet: Annotated[bool, Opt("--quiet", help="No live progress display.")] = False) -> None:
    if ctx.invoked_subcommand:
        return
    from llmopt.stages.bench.dataset import load_requests, load_tokenizer
    from llmopt.stages.bench.server import running_server
    from llmopt.stages.errors import ConfigError

    if (url is None) == (server is None):
        raise ConfigError("give --url URL of a running server, or --server SOURCE to start one")
    config, data, bounds = build_config(locals())
    spec = server_spec(server, locals()) if server else None
    with err.status(f"loading tokenizer {tokenizer}") if tokenizer else nullcontext():
        requests = load_requests(data, load_tokenizer(tokenizer) if tokenizer else None)
    with running_server(spec, note) if spec else nullcontext(config.url) as base:
        config = replace(config, url=base)
        report = _bench(config, data, requests, spec, quiet)
    raise typer.Exit(_finish(report, bounds, json, plot))


def build_config(o: dict):
    """(BenchConfig, DatasetConfig, fail-on bounds), validated, for `run`'s options (also what a recipe's
    bench stage takes; there the server is started on the stage's input)."""
    from llmopt.stages.bench import config as cfg
    from llmopt.stages.bench.dataset import DatasetConfig
    from llmopt.stages.bench.gate import parse_fail_on

    bounds = parse_fail_on(o["fail_on"])
    url = o.get("url")
    config = cfg.BenchConfig(url=cfg.normalize_url(url) if url else "http://127.0.0.1", endpoint=o["endpoint"],
                             model=o.get("model"), api_key=o.get("api_key"), request_rate=cfg.parse_rate(o["request_rate"]),
                             burstiness=o["burstiness"], max_concurrency=o["max_concurrency"], warmup=o["warmup"],
                             seed=o["seed"], temperature=o["temperature"], ignore_eos=o["ignore_eos"],
                             timeout_s=o["timeout"], slo=cfg.parse_slo(o["slo"]))
    config.validate()
    data = DatasetConfig(o["dataset"], o["num_prompts"], o["input_len"], o["output_len"], o["seed"], o["tokenizer"])
    data.validate()
    return config, data, bounds


def server_spec(source: str, o: dict):
    """The validated ServerSpec that starts a server on `source` with `run`'s --engine/--serve-args options."""
    from llmopt.stages.bench.server import ServerSpec

    spec = ServerSpec(source, o["engine"], tuple(a for s in o["serve_args"] or () for a in shlex.split(s)),
                      startup_timeout_s=o["server_timeout"])
    spec.validate()
    return spec


def _bench(config, data, requests, spec, quiet: bool) -> dict:
    from llmopt.stages.bench.report import build_report
    from llmopt.stages.bench.runner import run_bench

    note(f"{len(requests)} requests to {config.api_url}, rate {config.describe()['request_rate']}, "
         f"max concurrency {config.max_concurrency or 'unlimited'}")
    with bench_view.live_progress(len(requests), quiet) as on_result:
        result = run_bench(config, requests, on_result=on_result)
    return build_report(config, data, result, server=spec.describe() if spec else None)


def _finish(report: dict, bounds, json_path: Optional[Path], plot_path: Optional[Path]) -> int:
    from llmopt.stages.bench.gate import broken_bounds
    from llmopt.stages.bench.plot import write_plot
    from llmopt.stages.bench.report import write_report

    bench_view.render_report(report)
    for line in bench_view.notes(report):
        note(line)
    if json_path:
        write_report(report, json_path)
        note(f"wrote {json_path}")
    if plot_path:
        write_plot(report, plot_path)
        note(f"wrote {plot_path}")
    if report["interrupted"]:
        err.print(f"[yellow]interrupted: partial report of {report['completed'] + report['failed']} finished "
                  f"of {report['planned']} requests[/yellow]")
        return 130
    broken = broken_bounds(bounds, report)
    for why in broken:
        err.print(f"[bold red]fail-on:[/bold red] {why}", highlight=False)
    return 1 if broken or report["completed"] == 0 else 0  # a run that measured nothing must not pass CI


@app.command("compare", help="Side-by-side table of two --json reports; exit 1 on a regression beyond the bound.")
def compare(base: Annotated[Path, typer.Argument(help="The reference report (JSON).")],
            new: Annotated[Path, typer.Argument(help="The report to check (JSON).")],
            max_regression: Annotated[str, Opt("--max-regression", help="Allowed change for the worse, e.g. 10%.")] = "10%",
            metric: Annotated[Optional[list[str]], Opt("--metric", help="Only these metrics (repeatable).")] = None) -> None:
    from llmopt.stages.bench.gate import compare as compare_reports
    from llmopt.stages.bench.gate import parse_fraction
    from llmopt.stages.bench.report import load_report

    bound = parse_fraction(max_regression)
    old_report, new_report = load_report(base), load_report(new)
    rows = compare_reports(old_report, new_report, bound, metric)
    bench_view.render_compare(rows, base.name, new.name, bound)
    for key in ("dataset", "num_prompts", "request_rate", "max_concurrency", "endpoint"):
        if old_report.get(key) != new_report.get(key):
            note(f"the runs differ in {key}: {old_report.get(key)} vs {new_report.get(key)}")
    regressions = [r for r in rows if r.verdict == "REGRESSION"]
    for r in regressions:
        err.print(f"[bold red]regression:[/bold red] {r.metric} {r.base:.6g} -> {r.new:.6g} "
                  f"({'' if r.change is None else f'{r.change:+.1%}, '}bound {bound:.0%})", highlight=False)
    if not regressions:
        out.print(f"no regression beyond {bound:.0%}")
    raise typer.Exit(1 if regressions else 0)
