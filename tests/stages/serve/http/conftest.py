"""A real server on a free loopback port, serving a tiny random Llama (uvicorn in a thread)."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import torch

from tests.helpers import write_chat_model_dir

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def served(monkeypatch):
    """The ServerConfig `llmopt serve` would serve with; nothing is loaded or bound."""
    import llmopt.stages.serve.build as build
    import llmopt.stages.serve.http.server as server

    configs = []
    monkeypatch.setattr(build, "build_engine", lambda *args, **kw: None)
    monkeypatch.setattr(server, "serve", lambda config, loader, **kw: configs.append(config))
    monkeypatch.delenv("LLMOPT_API_KEY", raising=False)
    return configs


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny random Llama whose tokenizer has a chat template."""
    return write_chat_model_dir(tmp_path_factory.mktemp("tiny-chat"), CHAT_TEMPLATE)


def make_engine(model_dir, step_delay: float = 0.0, **overrides):
    """The engine for the tiny model; `step_delay` seconds added to every step keep requests
    in flight long enough to disconnect, flood or time them out."""
    from llmopt.stages.serve.build import build_engine
    from llmopt.stages.serve.engine.config import EngineConfig

    config = dict(block_size=4, num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    engine = build_engine(str(model_dir), EngineConfig(**(config | overrides)), "cpu", torch.float32)
    if step_delay:
        execute = engine.runner.execute

        def slow_execute(step):
            time.sleep(step_delay)
            return execute(step)

        engine.runner.execute = slow_execute
    return engine


class RunningServer:
    def __init__(self, app, base_url: str):
        self.app, self.base_url = app, base_url

    @property
    def state(self):
        return self.app.state.server

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=30, **kw)


@contextmanager
def running(app):
    """Serve `app` with uvicorn on 127.0.0.1:<free port> in a thread; stop it on exit."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield RunningServer(app, f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def serve(model_dir, engine_overrides=None, step_delay: float = 0.0, **config):
    from llmopt.stages.serve.http import ServerConfig, create_app

    engine = make_engine(model_dir, step_delay, **(engine_overrides or {}))
    return running(create_app(ServerConfig(served_model_name="tiny", **config), engine=engine))


@pytest.fixture(scope="module")
def server(model_dir):
    with serve(model_dir, max_queued_requests=64) as running_server:
        yield running_server
