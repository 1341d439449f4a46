"""scripts/bench_scale_out.py: its streaming client's reading of each request's outcome (tokens, an error frame,
[DONE], a 429's Retry-After), the health timeline it times ejection by, and its command line. The runs themselves
start real replicas and take minutes: `make bench-scale-out`; the router's behaviour is tested in tests/stages/route."""
import asyncio
import importlib.util
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_scale_out.py"
spec = importlib.util.spec_from_file_location("bench_scale_out", SCRIPT)
bench_scale_out = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_scale_out)


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict):
        if body["prompt"] == "limited":
            return JSONResponse({"error": {"message": "over"}}, status_code=429, headers={"Retry-After": "2"})
        frames = ['{"choices": [{"text": "a", "finish_reason": null}]}',
                  '{"choices": [{"text": "b", "finish_reason": "length"}]}']
        if body["prompt"] == "cut":
            frames = frames[:1] + ['{"error": {"code": "replica_failed", "message": "gone"}}']

        async def events():
            for frame in [*frames, "[DONE]"]:
                yield f"data: {frame}\n\n".encode()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _outcome(prompt: str) -> dict:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(_app()), base_url="http://replica") as client:
            return await bench_scale_out.stream_one(client, "http://replica", prompt, 2, key="k")
    return asyncio.run(go())


def test_a_whole_stream_a_cut_one_and_a_429_are_told_apart():
    whole = _outcome("ok")
    assert (whole["status"], whole["tokens"], whole["done"], whole["error_frame"], whole["finish_reason"]) == \
        (200, 2, True, False, "length") and whole["first_token"] >= whole["start"]
    cut = _outcome("cut")
    assert (cut["tokens"], cut["error_frame"], cut["done"], cut["cut"]) == (1, True, True, False)
    limited = _outcome("limited")
    assert (limited["status"], limited["retry_after"], limited["tokens"], limited["first_token"]) == (429, "2", 0, None)


def test_ejection_and_readmission_are_read_from_the_router_timeline():
    samples = [(1.0, {"r": True}), (2.0, {"r": True}), (2.5, {"r": False}), (4.0, {"r": False}), (4.2, {"r": True})]
    assert bench_scale_out._first(samples, 1.5, "r", False) == 2.5
    assert bench_scale_out._first(samples, 3.0, "r", True) == 4.2
    assert bench_scale_out._first(samples, 5.0, "r", True) is None


def test_it_needs_two_cores(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_scale_out.os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(SystemExit, match="two cores"):
        bench_scale_out.main([str(tmp_path), "cache"])
