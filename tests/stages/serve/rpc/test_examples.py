"""The gRPC examples README.md and docs/grpc.md show, run against a real server (tiny random Llama).

The Python example runs as written, with the port swapped for the test server's. grpcurl cannot be installed
here (no Go toolchain, no PyPI package), so each grpcurl line is checked for what grpcurl would do with it: the
method exists on the server (through reflection, as grpcurl finds it), the `-d` JSON parses into the method's
request message with the proto's field names (unknown ones refused, as grpcurl refuses them), and that request,
sent with the Python client, succeeds.
"""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
from google.protobuf import json_format, symbol_database
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from llmopt.stages.grpc_api import generate_pb2  # noqa: F401  (registers the messages for symbol_database)

ROOT = Path(__file__).resolve().parents[4]
PAGES = (ROOT / "README.md", ROOT / "docs" / "grpc.md")
EXAMPLE_PORT = "127.0.0.1:50051"


def blocks(page: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", page.read_text(encoding="utf-8"), flags=re.M | re.S)


def grpcurl_lines() -> list[list[str]]:
    return [shlex.split(line) for page in PAGES for block in blocks(page, "bash") for line in block.splitlines()
            if line.startswith("grpcurl ")]


def test_the_pages_show_the_examples():
    assert all(any(EXAMPLE_PORT in b for b in blocks(page, "python")) for page in PAGES)
    assert any("GenerateStream" in line for line in map(" ".join, grpcurl_lines()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_python_example_streams_the_greedy_completion(rpc, page):
    code = next(b for b in blocks(page, "python") if EXAMPLE_PORT in b)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace(EXAMPLE_PORT, f"127.0.0.1:{rpc.port}"), str(page), "exec"), {})
    with rpc.http.client() as client:
        http = client.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 16,
                                                    "temperature": 0}).json()
    assert printed.getvalue() == http["choices"][0]["text"]


def test_each_grpcurl_line_names_a_method_and_a_request_the_server_takes(rpc):
    database = ProtoReflectionDescriptorDatabase(rpc.channel)
    services = set(database.get_services())
    for argv in grpcurl_lines():
        assert argv[:2] == ["grpcurl", "-plaintext"] and EXAMPLE_PORT in argv, argv
        target = argv[argv.index(EXAMPLE_PORT) + 1:]
        if target == ["list"]:
            assert {"llmopt.v1.Generation", "grpc.health.v1.Health"} <= services
            continue
        (method,) = target
        service_name, _, method_name = method.partition("/")
        assert service_name in services, method
        file = database.FindFileContainingSymbol(service_name)
        service = next(s for s in file.service if f"{file.package}.{s.name}" == service_name)
        spec = next(m for m in service.method if m.name == method_name)
        request = symbol_database.Default().GetSymbol(spec.input_type.lstrip(".")) if spec.input_type.startswith(
            ".llmopt.") else None
        if "-H" in argv:
            key, _, value = argv[argv.index("-H") + 1].partition(": ")
            assert key == "authorization" and value.startswith("Bearer ")
        if request is None:  # the health check: no body
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            assert spec.input_type == ".grpc.health.v1.HealthCheckRequest"
            status = health_pb2_grpc.HealthStub(rpc.channel).Check(health_pb2.HealthCheckRequest())
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            continue
        message = json_format.Parse(argv[argv.index("-d") + 1], request())
        call = rpc.channel.unary_stream(f"/{method}", request_serializer=request.SerializeToString,
                                        response_deserializer=generate_pb2.GenerateStreamResponse.FromString)
        chunks = list(call(message, timeout=60))
        assert sum(len(c.token_ids) for c in chunks) == message.max_tokens or \
            chunks[-1].finish_reason == generate_pb2.FINISH_REASON_STOP


def test_unknown_json_fields_are_refused_as_grpcurl_refuses_them():
    with pytest.raises(json_format.ParseError):
        json_format.Parse('{"prompt": "x"}', generate_pb2.GenerateRequest())
