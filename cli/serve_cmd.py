"""llmopt serve SOURCE: the OpenAI-compatible HTTP server (see stages/serve/http)."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from .options import DType, DTypeOpt, MasterAddr, MasterPort, NNodes, NodeRank, Source

Opt = typer.Option


def run(source: Source,
        host: Annotated[str, Opt("--host", help="Address to bind (loopback unless you open it).")] = "127.0.0.1",
        port: Annotated[int, Opt("--port", min=0, max=65535)] = 8000,
        api_key: Annotated[Optional[str], Opt("--api-key", envvar="LLMOPT_API_KEY",
                                              help="Require 'Authorization: Bearer KEY' (all but /health).")] = None,
        served_model_name: Annotated[Optional[str], Opt("--served-model-name", help="Default: SOURCE.")] = None,
        metrics_public: Annotated[bool, Opt("--metrics-public", help="/metrics without the API key.")] = False,
        max_queued_requests: Annotated[int, Opt("--max-queued-requests", min=0, help="Waiting sequences beyond "
                                                "the running batch; more get 503 + Retry-After.")] = 256,
        max_queued_tokens: Annotated[int, Opt("--max-queued-tokens", min=1, help="Prompt tokens not yet "
                                              "prefilled; more get 503 + Retry-After.")] = 262_144,
        max_body_bytes: Annotated[int, Opt("--max-body-bytes", min=1)] = 4 * 1024 * 1024,
        request_timeout: Annotated[Optional[float], Opt("--request-timeout", help="Seconds; abort a request "
                                                        "still running (504).")] = None,
        drain_timeout: Annotated[float, Opt("--drain-timeout", help="Seconds in-flight requests may finish "
                                            "after SIGTERM/SIGINT.")] = 30.0,
        log_json: Annotated[bool, Opt("--log-json", help="Access log as JSON lines.")] = False,
        block_size: Annotated[int, Opt("--block-size", min=1)] = 16,
        kv_cache_memory: Annotated[Optional[str], Opt("--kv-cache-memory", help="Bytes (4GiB) or a fraction "
                                                      "of free memory (0.5).")] = None,
        max_num_seqs: Annotated[int, Opt("--max-num-seqs", min=1)] = 64,
        max_num_batched_tokens: Annotated[int, Opt("--max-num-batched-tokens", min=1)] = 2048,
        max_model_len: Annotated[Optional[int], Opt("--max-model-len", min=1)] = None,
        max_batch_size: Annotated[Optional[int], Opt("--max-batch-size", min=1)] = None,
        max_wait_ms: Annotated[float, Opt("--max-wait-ms", min=0.0)] = 0.0,
        device: Annotated[str, Opt("--device", help="cpu | cuda")] = "cpu",
        dtype: DTypeOpt = DType.auto, nnodes: NNodes = 1, node_rank: NodeRank = 0,
        master_addr: MasterAddr = "127.0.0.1", master_port: MasterPort = None) -> None:
    from llmopt.stages.model_io import parse_dtype
    from llmopt.stages.serve.engine.build import build_engine
    from llmopt.stages.serve.engine.config import EngineConfig
    from llmopt.stages.serve.http.config import ServerConfig
    from llmopt.stages.serve.http.server import serve
    from llmopt.stages.serve.tp.launch import TPOptions, run_worker_node
    from llmopt.stages.source import resolve

    resolve(source)  # a wrong path or alias fails now, before the port is bound
    tp = TPOptions(nnodes, node_rank, master_addr, master_port)
    if node_rank > 0:  # this machine only runs its ranks of a sharded artifact; node 0 serves
        raise typer.Exit(run_worker_node(source, tp, device, parse_dtype(dtype.value)))
    engine_config = EngineConfig(block_size=block_size, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                 max_batch_size=max_batch_size, max_wait_ms=max_wait_ms)
    config = ServerConfig(host=host, port=port, api_key=api_key, served_model_name=served_model_name or source,
                          metrics_public=metrics_public, max_queued_requests=max_queued_requests,
                          max_queued_tokens=max_queued_tokens, max_body_bytes=max_body_bytes,
                          request_timeout_s=request_timeout, drain_timeout_s=drain_timeout, log_json=log_json)
    torch_dtype = parse_dtype(dtype.value)
    serve(config, lambda: build_engine(source, engine_config, device, torch_dtype, tp_options=tp))
