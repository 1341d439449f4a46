"""GET /v1/models, /health (and /ping, as vLLM), /version and /metrics."""
from __future__ import annotations

import time
from importlib import metadata

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from .common import ERROR_RESPONSES, check_model, server_state
from .prometheus import CONTENT_TYPE

router = APIRouter()
STARTED = int(time.time())


@router.get("/v1/models", responses=ERROR_RESPONSES)
async def list_models(request: Request):
    state = server_state(request)
    state.ready_engine()
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/v1/models/{model}", responses=ERROR_RESPONSES)
async def retrieve_model(model: str, request: Request):
    state = server_state(request)
    state.ready_engine()
    check_model(model, state)
    return _model_card(state)


def _model_card(state) -> dict:
    return {"id": state.config.served_model_name, "object": "model", "created": STARTED, "owned_by": "llmopt",
            "max_model_len": state.max_model_len}


@router.get("/health", responses={503: {"description": "loading, shutting down, or the engine is dead"}})
async def health(request: Request):
    """200 when the engine is loaded and running, with its running and waiting requests (what a router's
    least-load reads, without rendering /metrics); 503 while loading, draining, or when it has died."""
    state = server_state(request)
    if state.healthy:
        stats = state.stats()
        return {"status": "ok", "num_requests_running": stats.num_running, "num_requests_waiting": stats.num_waiting}
    if state.draining:
        status = "draining"
    elif state.engine is None:
        status = "load_failed" if state.load_error is not None else "loading"
    else:
        status = "engine_dead"
    return JSONResponse({"status": status}, status_code=503)


@router.get("/ping", responses={503: {"description": "as /health"}})
@router.post("/ping", include_in_schema=False)  # no body to document (or to fuzz); GET /ping is the same
async def ping(request: Request):
    """vLLM's (and SageMaker's) name for /health."""
    return await health(request)


@router.get("/version")
async def version():
    """{"version": llmopt's version}, as vLLM answers with its own."""
    try:
        return {"version": metadata.version("llmopt")}
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return {"version": "unknown"}


@router.get("/metrics", response_class=PlainTextResponse)  # for the OpenAPI schema: text
async def metrics(request: Request):
    """Prometheus text format by prometheus_client; our names prefixed `llmopt:`, each with a `model_name` label."""
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)
