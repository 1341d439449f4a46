"""`llmopt serve --grpc-port`: the gRPC API over a real server (tiny random Llama), driven by a grpcio client."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmopt.stages.grpc_api import generate_pb2 as pb

from tests.stages.serve.http.prom_text import value

from .conftest import engine_is_idle, grpc_serve, wait_until

LONG = dict(text="a long one", max_tokens=100, ignore_eos=True, temperature=0.0)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def error_of(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def trailers(error: grpc.RpcError) -> dict[str, str]:
    return {item.key: item.value for item in error.trailing_metadata() or ()}


def test_streamed_greedy_tokens_equal_the_http_apis(rpc):
    prompt = [5, 9, 31, 7, 2]
    messages = list(rpc.stub().GenerateStream(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_tokens=12,
                                                                 temperature=0.0, ignore_eos=True, logprobs=0)))
    with rpc.http.client() as client:
        http = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0.0,
                                                    "ignore_eos": True, "logprobs": 0}).json()
    ids = [t for m in messages for t in m.token_ids]
    assert len(ids) == 12 and messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    assert "".join(m.text for m in messages) == http["choices"][0]["text"]
    assert messages[-1].usage == pb.Usage(prompt_tokens=5, completion_tokens=12, total_tokens=17)
    token_logprobs = [lp.logprob for m in messages for lp in m.logprobs]
    assert token_logprobs == pytest.approx(http["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5)
    # the same request through Generate: one response with the same tokens
    whole = rpc.stub().Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_tokens=12, temperature=0.0,
                                                   ignore_eos=True))
    assert list(whole.choices[0].token_ids) == ids and whole.model == "tiny" and whole.id.startswith("cmpl-")


def test_generate_with_choices_seed_logprobs_and_chat(rpc):
    request = pb.GenerateRequest(text="hello", max_tokens=4, n=2, seed=7, temperature=1.0, logprobs=2,
                                 ignore_eos=True)
    first, again = rpc.stub().Generate(request), rpc.stub().Generate(request)
    assert [c.index for c in first.choices] == [0, 1] and first.usage.completion_tokens == 8
    assert [list(c.token_ids) for c in first.choices] == [list(c.token_ids) for c in again.choices]  # seeded
    assert all(len(lp.top_logprobs) == 2 for c in first.choices for lp in c.logprobs)
    chat = rpc.stub().Generate(pb.GenerateRequest(messages=pb.Conversation(messages=[
        pb.ChatMessage(role="user", content="hi")]), max_tokens=3, temperature=0.0, ignore_eos=True))
    assert chat.id.startswith("chatcmpl-") and len(chat.choices[0].token_ids) == 3
    tokens = rpc.stub().Tokenize(pb.TokenizeRequest(messages=pb.Conversation(messages=[
        pb.ChatMessage(role="user", content="hi")])))
    assert chat.usage.prompt_tokens == tokens.count  # rendered through the chat template, as /tokenize does


def test_tokenize_detokenize_and_models(rpc):
    stub = rpc.stub()
    tokens = stub.Tokenize(pb.TokenizeRequest(text="hello", return_token_strs=True))
    assert tokens.count == len(tokens.token_ids) == len(tokens.token_strs) and tokens.max_model_len == 128
    assert stub.Detokenize(pb.DetokenizeRequest(token_ids=tokens.token_ids)).text.endswith("hello")
    assert [m.id for m in stub.ListModels(pb.ListModelsRequest()).models] == ["tiny"]
    error = error_of(lambda: stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, 10**6])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("token_ids[1]")


@pytest.mark.parametrize("request_fields, field", [
    (dict(text="x", temperature=5.0), "temperature"),
    (dict(text="x", top_p=0.0), "top_p"),
    (dict(text="x", n=0), "n"),
    (dict(text="x", logprobs=21), "logprobs"),
    (dict(token_ids=pb.TokenIds(ids=[])), "token_ids.ids"),
    (dict(token_ids=pb.TokenIds(ids=[2**31])), "token_ids.ids[0]"),
    (dict(), "prompt"),
    (dict(text="x", max_tokens=1000), "max_tokens"),  # past the context length
    (dict(messages=pb.Conversation(messages=[pb.ChatMessage(role="robot", content="x")])),
     "messages.messages[0].role"),
])
def test_invalid_arguments_name_the_field(rpc, request_fields, field):
    error = error_of(lambda: rpc.stub().Generate(pb.GenerateRequest(**request_fields)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details().startswith(field) and trailers(error)["llmopt-error-param"] == field
    stream = error_of(lambda: list(rpc.stub().GenerateStream(pb.GenerateRequest(**request_fields))))
    assert stream.code() == grpc.StatusCode.INVALID_ARGUMENT and stream.details() == error.details()


def test_a_model_other_than_the_served_one_is_not_found(rpc):
    error = error_of(lambda: rpc.stub().Generate(pb.GenerateRequest(text="x", model="gpt-4")))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "'tiny'" in error.details()


def test_api_key_as_bearer_metadata(model_dir):
    with grpc_serve(model_dir, api_key="sekrit") as locked:
        request = pb.GenerateRequest(text="x", max_tokens=2)
        for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", "sekrit"),)):
            error = error_of(lambda: locked.stub().Generate(request, metadata=metadata))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer" in error.details()
        error = error_of(lambda: list(locked.stub().GenerateStream(request)))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        good = (("authorization", "Bearer sekrit"),)
        assert locked.stub().Generate(request, metadata=good).usage.completion_tokens >= 1
        assert locked.stub().ListModels(pb.ListModelsRequest(), metadata=good).models[0].id == "tiny"
        health = health_pb2_grpc.HealthStub(locked.channel)  # open, as /health is
        assert health.Check(health_pb2.HealthCheckRequest(service="llmopt.v1.Generation")).status == SERVING


def test_a_flood_gets_resource_exhausted_with_retry_after(model_dir):
    with grpc_serve(model_dir, engine_overrides=dict(max_num_seqs=2), step_delay=0.02, max_queued_requests=1,
                    retry_after_s=3) as busy:
        def one(_):
            try:
                return sum(m.usage.completion_tokens for m in busy.stub().GenerateStream(
                    pb.GenerateRequest(text="x", max_tokens=20, ignore_eos=True)))
            except grpc.RpcError as e:
                return e
        with ThreadPoolExecutor(12) as pool:
            outcomes = list(pool.map(one, range(12)))
        refused = [o for o in outcomes if isinstance(o, grpc.RpcError)]
        assert refused and all(o.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for o in refused)
        assert trailers(refused[0])["retry-after"] == "3" and trailers(refused[0])["llmopt-error-code"] == "queue_full"
        assert all(o == 20 for o in outcomes if not isinstance(o, grpc.RpcError))  # the admitted ones finish
        with busy.http.client() as client:
            metrics = client.get("/metrics").text
        assert value(metrics, "llmopt:requests_rejected_total", reason="queue_full") == len(refused)


def test_an_expired_deadline_aborts_and_frees_every_block(slow):
    engine = slow.state.engine
    initial, aborted = engine.stats().num_free_blocks, engine.stats().finished.get("abort", 0)
    for call in (lambda: list(slow.stub().GenerateStream(pb.GenerateRequest(**LONG), timeout=0.3)),
                 lambda: slow.stub().Generate(pb.GenerateRequest(**LONG), timeout=0.3)):
        started = time.monotonic()
        error = error_of(call)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started < 2.0
    wait_until(lambda: engine_is_idle(slow, initial) and engine.stats().finished.get("abort", 0) == aborted + 2)


def test_cancelling_mid_stream_frees_every_kv_block(slow):
    engine = slow.state.engine
    initial, aborted = engine.stats().num_free_blocks, engine.stats().finished.get("abort", 0)
    call = slow.stub().GenerateStream(pb.GenerateRequest(**LONG))
    received = [next(call) for _ in range(3)]
    assert all(m.token_ids for m in received) and engine.stats().num_free_blocks < initial
    call.cancel()
    wait_until(lambda: engine_is_idle(slow, initial))
    assert engine.stats().finished.get("abort", 0) == aborted + 1 and not slow.state.in_flight


def test_health_follows_loading_load_and_drain(model_dir):
    from tests.stages.serve.http.conftest import make_engine

    release = threading.Event()

    def load():
        release.wait(30)
        return make_engine(model_dir, step_delay=0.01)

    with grpc_serve(model_dir, loader=load) as server:
        health = health_pb2_grpc.HealthStub(server.channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service="llmopt.v1.Generation"))
        assert next(watch).status == NOT_SERVING  # loading
        assert health.Check(health_pb2.HealthCheckRequest(service="")).status == NOT_SERVING
        error = error_of(lambda: server.stub().Generate(pb.GenerateRequest(text="x")))
        assert error.code() == grpc.StatusCode.UNAVAILABLE and trailers(error)["llmopt-error-code"] == "loading"
        release.set()
        assert next(watch).status == SERVING
        stream = server.stub().GenerateStream(pb.GenerateRequest(**LONG))  # under load it stays SERVING
        next(stream)
        assert health.Check(health_pb2.HealthCheckRequest(service="")).status == SERVING
        server.state.draining = True  # what SIGTERM does first
        assert next(watch).status == NOT_SERVING
        error = error_of(lambda: server.stub().Generate(pb.GenerateRequest(text="x")))
        assert error.code() == grpc.StatusCode.UNAVAILABLE and trailers(error)["llmopt-error-code"] == "draining"
        assert sum(1 for _ in stream) >= 1  # the stream in flight runs on
        unknown = error_of(lambda: health.Check(health_pb2.HealthCheckRequest(service="no.such.Service")))
        assert unknown.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_services(rpc):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    database = ProtoReflectionDescriptorDatabase(rpc.channel)
    services = set(database.get_services())
    assert {"llmopt.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    described = database.FindFileContainingSymbol("llmopt.v1.Generation")
    assert described.name == "llmopt/v1/generate.proto" and described.package == "llmopt.v1"
    assert [m.name for m in described.service[0].method] == ["Generate", "GenerateStream", "Tokenize", "Detokenize",
                                                              "ListModels"]


def test_metrics_carry_the_protocol(model_dir):
    with grpc_serve(model_dir) as server:
        list(server.stub().GenerateStream(pb.GenerateRequest(text="x", max_tokens=3, ignore_eos=True)))
        with server.http.client() as client:
            client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "ignore_eos": True})
            metrics = client.get("/metrics").text
        assert value(metrics, "llmopt:generation_tokens_total", protocol="grpc") == 3
        assert value(metrics, "llmopt:generation_tokens_total", protocol="http") == 2
        assert value(metrics, "llmopt:time_to_first_token_seconds_count", protocol="grpc") == 1


def test_a_grpc_port_in_use_is_one_clear_error(model_dir):
    import socket

    from llmopt.stages.errors import LlmoptError
    from llmopt.stages.serve.http import ServerConfig
    from llmopt.stages.serve.http.state import ServerState
    from llmopt.stages.serve.rpc import start_grpc

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        state = ServerState(ServerConfig(grpc_port=taken.getsockname()[1]))
        with pytest.raises(LlmoptError, match=r"--grpc-port \d+: cannot listen on 127.0.0.1:\d+"):
            asyncio.run(start_grpc(state))
    finally:
        taken.close()
