"""A real server on free loopback ports, HTTP and gRPC over one tiny random Llama (uvicorn in a thread)."""
from __future__ import annotations

from contextlib import contextmanager

import grpc
import pytest

from tests.stages.serve.http.conftest import make_engine, model_dir, one_torch_thread, running  # noqa: F401
from tests.stages.serve.http.test_lifecycle import engine_is_idle, wait_until  # noqa: F401


class GrpcServer:
    """The running HTTP server (`http`: conftest's RunningServer) and a channel to its gRPC port."""

    def __init__(self, http):
        self.http = http
        self.port = http.state.grpc_port
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")

    @property
    def state(self):
        return self.http.state

    def stub(self):
        from llmopt.stages.grpc_api import generate_pb2_grpc

        return generate_pb2_grpc.GenerationStub(self.channel)


@contextmanager
def grpc_serve(model_dir, engine_overrides=None, step_delay: float = 0.0, loader=None, **config):
    """An app with the gRPC service on a free port (grpc_port=0), served; a loader instead of an engine
    loads in the background, as `llmopt serve` does."""
    from llmopt.stages.serve.http import ServerConfig, create_app
    from llmopt.stages.serve.rpc import start_grpc

    settings = ServerConfig(served_model_name="tiny", grpc_port=0, drain_timeout_s=2.0, **config)
    if loader is None:
        app = create_app(settings, engine=make_engine(model_dir, step_delay, **(engine_overrides or {})),
                         services=[start_grpc])
    else:
        app = create_app(settings, loader=loader, services=[start_grpc])
    with running(app) as http:
        server = GrpcServer(http)
        try:
            yield server
        finally:
            server.channel.close()


@pytest.fixture(scope="module")
def rpc(model_dir):
    with grpc_serve(model_dir, max_queued_requests=64) as server:
        yield server


@pytest.fixture(scope="module")
def slow(model_dir):
    with grpc_serve(model_dir, step_delay=0.01) as server:
        yield server
