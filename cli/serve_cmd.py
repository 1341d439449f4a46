"""llmopt serve SOURCE: the OpenAI-compatible HTTP server (see stages/serve/http)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmopt.stages.serve.config import DEFAULTS, OPTIONS, ServeConfig

from .options import (Backend, BackendOpt, DType, DTypeOpt, MasterAddr, MasterPort, NNodes, NodeRank,
                      NumSpeculativeTokens, Source, Speculative, SpeculativeJson, TensorParallelSize, Threads,
                      stage_options)

Opt = typer.Option
E, S, T = DEFAULTS.engine, DEFAULTS.server, DEFAULTS.tp  # every default below is read from ServeConfig
O = OPTIONS.defaults  # those of options that are no config field (--api-key-file, --api-keys-file)


def run(ctx: typer.Context, source: Source,
        config: Annotated[Optional[Path], Opt("--config", help="YAML file of options, as vllm serve --config: "
                                              "long option names as keys; the command line wins.")] = None,
        host: Annotated[str, Opt("--host", help="Address to bind (loopback unless you open it).")] = S.host,
        port: Annotated[int, Opt("--port", min=0, max=65535)] = S.port,
        grpc_port: Annotated[Optional[int], Opt("--grpc-port", min=0, max=65535, help="Also serve the gRPC API "
                                                "(llmopt.v1.Generation, health, reflection) on this port "
                                                "(docs/grpc.md).")] = S.grpc_port,
        api_key: Annotated[Optional[str], Opt("--api-key", envvar="LLMOPT_API_KEY", help="Require "
                                              "'Authorization: Bearer KEY' (all but /health).")] = S.api_key,
        api_key_file: Annotated[Optional[str], Opt("--api-key-file", help="Read the key from this file (kept out "
                                                   "of `ps`), instead of --api-key.")] = O.api_key_file,
        api_keys_file: Annotated[Optional[str], Opt("--api-keys-file", help="YAML file of keys, each a tenant "
                                                    "with optional max_concurrency and tokens_per_minute "
                                                    "(docs/serve.md, Tenants); not with --api-key.")] = O.api_keys_file,
        served_model_name: Annotated[Optional[str], Opt("--served-model-name", help="Default: SOURCE.")] = None,
        metrics_public: Annotated[bool, Opt("--metrics-public",
                                            help="/metrics without the API key.")] = S.metrics_public,
        max_queued_requests: Annotated[int, Opt("--max-queued-requests", min=0, help="Waiting sequences beyond the "
                                                "running batch; more get 503 + Retry-After.")] = S.max_queued_requests,
        max_queued_tokens: Annotated[int, Opt("--max-queued-tokens", min=1, help="Prompt tokens not yet "
                                              "prefilled; more get 503 + Retry-After.")] = S.max_queued_tokens,
        max_body_bytes: Annotated[int, Opt("--max-body-bytes", min=1)] = S.max_body_bytes,
        request_timeout: Annotated[Optional[float], Opt("--request-timeout", help="Seconds; abort a request "
                                                        "still running (504).")] = S.request_timeout_s,
        drain_grace: Annotated[float, Opt("--drain-grace", help="Seconds to keep accepting after SIGTERM (503 "
                                          "to /health and new requests) before the port closes.")] = S.drain_grace_s,
        drain_timeout: Annotated[float, Opt("--drain-timeout", help="Then seconds in-flight requests may finish "
                                            "before they are aborted.")] = S.drain_timeout_s,
        header_timeout: Annotated[float, Opt("--header-timeout", help="Seconds a connection may take to send its "
                                             "request headers, or stall in a body (408).")] = S.header_timeout_s,
        keep_alive_timeout: Annotated[float, Opt("--keep-alive-timeout", help="Seconds an idle keep-alive "
                                                 "connection stays open.")] = S.keep_alive_timeout_s,
        max_connections: Annotated[int, Opt("--max-connections", min=1, help="Open connections; past this a "
                                            "request gets 503 at once.")] = S.max_connections,
        log_json: Annotated[bool, Opt("--log-json", help="Access log as JSON lines.")] = S.log_json,
        block_size: Annotated[int, Opt("--block-size", min=1)] = E.block_size,
        kv_cache_memory: Annotated[Optional[str], Opt("--kv-cache-memory", help="Bytes (4GiB) or a fraction "
                                                      "of free memory (0.5).")] = E.kv_cache_memory,
        gpu_memory_utilization: Annotated[Optional[float], Opt("--gpu-memory-utilization", min=0.0, max=1.0, help=
                                                               "vLLM's sizing: the share of the device's memory "
                                                               "this process may use, weights included; the KV "
                                                               "cache gets the rest.")] = E.gpu_memory_utilization,
        max_num_seqs: Annotated[int, Opt("--max-num-seqs", min=1)] = E.max_num_seqs,
        max_num_batched_tokens: Annotated[int, Opt("--max-num-batched-tokens", min=1)] = E.max_num_batched_tokens,
        max_model_len: Annotated[Optional[int], Opt("--max-model-len", min=1)] = E.max_model_len,
        max_batch_size: Annotated[Optional[int], Opt("--max-batch-size", min=1)] = E.max_batch_size,
        max_wait_ms: Annotated[float, Opt("--max-wait-ms", min=0.0)] = E.max_wait_ms,
        enforce_eager: Annotated[bool, Opt("--enforce-eager", help="No CUDA graphs: decode steps launch "
                                            "their kernels one by one (CUDA, triton backend).")] = E.enforce_eager,
        speculative: Speculative = O.speculative, num_speculative_tokens: NumSpeculativeTokens = O.num_speculative_tokens,
        speculative_config: SpeculativeJson = O.speculative_config,
        device: Annotated[str, Opt("--device", help="cpu | cuda")] = DEFAULTS.device,
        dtype: DTypeOpt = DType(DEFAULTS.dtype), backend: BackendOpt = Backend(DEFAULTS.backend),
        nnodes: NNodes = T.nnodes, node_rank: NodeRank = T.node_rank, master_addr: MasterAddr = T.master_addr,
        master_port: MasterPort = T.master_port,
        tensor_parallel_size: TensorParallelSize = DEFAULTS.tensor_parallel_size,
        threads: Threads = DEFAULTS.threads,
        data_parallel: Annotated[int, Opt("--data-parallel", "-dp", min=1, help="Engine replicas behind this endpoint, "
                                          "each its own process and KV cache (CPU: its own cores).")] = DEFAULTS.data_parallel,
        cores_per_replica: Annotated[Optional[int], Opt("--cores-per-replica", min=1, help="--data-parallel on CPU: "
                                                        "cores pinned to each replica (default: shared out "
                                                        "evenly).")] = DEFAULTS.cores_per_replica,
        router_policy: Annotated[str, Opt("--router-policy", help="--data-parallel: cache-aware | least-load | "
                                          "round-robin (as llmopt route --policy).")] = DEFAULTS.router_policy) -> None:
    import gc

    args = {name: value for name, value in locals().items() if name != "gc"}
    # Start-up makes about a million objects that live as long as the process (torch's, the HTTP stack's):
    # cyclic collection meanwhile finds nothing and costs a fifth of torch's import here. Back on, with what
    # exists by then frozen out of its reach, once the server is ready.
    collecting = gc.isenabled()
    gc.disable()
    try:
        _serve(args, collecting)
    finally:
        if collecting:
            gc.enable()


def _serve(args: dict, collecting: bool) -> None:
    """`run` with the collector off (see there); `collecting`: whether to turn it back on once ready."""
    import gc
    import logging

    from llmopt.kernels.threads import apply_threads, describe, governor_for, usable_cpus
    from llmopt.stages.model_io import parse_dtype
    from llmopt.stages.serve.build import build_engine, warm_up_in_background
    from llmopt.stages.serve.startup import StartupReport
    from llmopt.stages.serve.tp.launch import run_worker_node
    from llmopt.stages.source import resolve

    startup = StartupReport()
    source = args["source"]
    options = _with_config_file(args, stage_options(args, ServeConfig.options()))
    config = ServeConfig.from_options(options | {"served_model_name": options["served_model_name"] or source})
    resolve(source)  # a wrong path or alias fails now, before the port is bound
    if config.data_parallel > 1:  # replicas in processes of their own, this one routes (data_parallel.py)
        from llmopt.stages.serve.data_parallel import serve_data_parallel

        raise typer.Exit(serve_data_parallel(source, options, config))
    torch_dtype = parse_dtype(config.dtype)
    count = apply_threads(usable_cpus(config.threads))  # before the model's first parallel region
    if config.tp.node_rank > 0:  # this machine only runs its ranks of a sharded artifact; node 0 serves
        from llmopt.stages.serve.tp.at_load import artifact_for_tp

        art = artifact_for_tp(source, config.tensor_parallel_size)
        raise typer.Exit(run_worker_node(art.path if art else source, config.tp, config.device, torch_dtype,
                                         config.backend))
    log = logging.getLogger("llmopt.serve")

    def load():  # in the server's loader thread, once the port is bound (/health: 503 until it returns)
        engine = build_engine(source, config.engine, config.device, torch_dtype, config.backend, tp_options=config.tp,
                              startup=startup, defer_warmup=True, tensor_parallel_size=config.tensor_parallel_size)
        if config.device == "cpu":
            engine.thread_governor = governor_for(count, on_change=lambda n, others: log.info(
                "threads: %d, as other processes keep %.1f of our CPUs busy", n, others))
        log.info(describe(count))
        startup.on_ready(lambda: warm_up_in_background(engine))
        return engine

    def collect_again() -> None:
        gc.freeze()  # start-up's objects stay: later collections need not walk them
        gc.enable()

    if collecting:
        startup.on_ready(collect_again)
    # Every import before the load, none beside it (startup.py says why).
    from llmopt.stages.serve.http.server import serve
    services = []
    if config.server.grpc_port is not None:
        from llmopt.stages.serve.rpc import start_grpc
        services.append(start_grpc)
    startup.mark("imports")
    serve(config.server, load, startup=startup, services=services)


def _with_config_file(args: dict, options: dict) -> dict:
    """The options with --config FILE's values for those the command line (or the environment) left unset."""
    from llmopt.stages.serve.config import options_from_file

    if args["config"] is None:
        return options
    ctx = args["ctx"]
    from_file = options_from_file(args["config"], args["source"], ServeConfig.options())
    return options | {name: value for name, value in from_file.items()
                      if getattr(ctx.get_parameter_source(name), "name", "DEFAULT") == "DEFAULT"}  # typer's own click
