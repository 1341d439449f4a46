"""`llmopt serve --grpc-port` as a real process: the option, the drain on SIGTERM with a gRPC stream in flight,
and the one-line errors for ports it cannot use."""
from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmopt.cli.main import main
from llmopt.stages.grpc_api import generate_pb2 as pb
from llmopt.stages.grpc_api import generate_pb2_grpc

from tests.stages.serve.http.conftest import served  # noqa: F401
from tests.stages.serve.http.serve_process import free_port, serve_process


def test_the_option_reaches_the_server_config(served, model_dir):  # noqa: F811
    assert main(["serve", str(model_dir), "--grpc-port", "50123"]) == 0
    assert served[0].grpc_port == 50123
    assert main(["serve", str(model_dir)]) == 0 and served[1].grpc_port is None


@pytest.mark.parametrize("args, expect", [
    (["--port", "9100", "--grpc-port", "9100"], "--grpc-port 9100 is the HTTP --port too"),
    (["--grpc-port", "9101", "--data-parallel", "2"], "--grpc-port with --data-parallel"),
])
def test_ports_it_cannot_use_are_one_line_and_exit_2(served, model_dir, capsys, args, expect):  # noqa: F811
    assert main(["serve", str(model_dir), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expect in err and not served


def test_sigterm_drains_grpc_streams_and_health_then_exits_0(model_dir, tmp_path):
    port = free_port()
    with serve_process(model_dir, "--grpc-port", str(port), "--drain-grace", "1", "--drain-timeout", "5",
                       step_delay=0.01, tmp_path=tmp_path) as server:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
            stream = generate_pb2_grpc.GenerationStub(channel).GenerateStream(
                pb.GenerateRequest(text="hi", max_tokens=60, ignore_eos=True, temperature=0.0))
            first = next(stream)
            server.terminate()
            deadline = time.monotonic() + 5
            while health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "health stayed SERVING after SIGTERM"
                time.sleep(0.05)
            rest = list(stream)  # the stream in flight finishes
            assert sum(len(m.token_ids) for m in [first, *rest]) == 60
            assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert server.proc.wait(30) == 0
        assert "gRPC API (llmopt.v1.Generation, health, reflection) on 127.0.0.1:" in server.stderr


def test_a_grpc_port_in_use_is_one_line_and_exit_2(model_dir, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with serve_process(model_dir, "--grpc-port", str(port), tmp_path=tmp_path, healthy=False) as server:
            assert server.proc.wait(60) == 2
            lines = [line for line in server.stderr.splitlines() if line.strip()]
            assert lines[-1].startswith(f"error: --grpc-port {port}: cannot listen on 127.0.0.1:{port}")
            assert "Traceback" not in server.stderr
