"""`llmopt bench --grpc`: the GenerateStream client, the runner and the command line against a real gRPC server
in this process, whose servicer streams scripted messages with scripted sleeps."""
import asyncio
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import pytest

from llmopt.cli.main import main
from llmopt.stages.bench import run as bench_run
from llmopt.stages.bench.config import BenchConfig, normalize_grpc_target
from llmopt.stages.bench.dataset import BenchRequest, DatasetConfig
from llmopt.stages.bench.grpc_client import grpc_session
from llmopt.stages.bench.report import build_report
from llmopt.stages.bench.runner import run_bench
from llmopt.stages.bench.server import ServerError, ServerSpec, stop, wait_grpc
from llmopt.stages.errors import ConfigError
from llmopt.stages.grpc_api import generate_pb2 as pb
from llmopt.stages.grpc_api import generate_pb2_grpc
from tests.stages.bench.stub import free_port

# prompt -> (seconds to sleep, text) per message before the last one, which carries the finish reason and usage
SCRIPTS = {
    # an empty text (a character still incomplete) is no arrival; usage counts its token
    "timed": ([(0.15, "a"), (0.05, "b"), (0.05, ""), (0.05, "c")], pb.Usage(prompt_tokens=7, completion_tokens=4)),
    "no usage": ([(0.0, "x"), (0.0, "y")], None),
    "stops at once": ([], pb.Usage(prompt_tokens=3, completion_tokens=0)),
    "slow": ([(1.0, "late")], None),
}
MODEL = "scripted-model"


class ScriptedGeneration(generate_pb2_grpc.GenerationServicer):
    """Streams SCRIPTS[prompt]; other prompts get max_tokens one-character messages 10 ms apart; a prompt of FULL
    is refused with RESOURCE_EXHAUSTED. Records each request, its metadata and the most calls at once."""

    def __init__(self):
        self.requests, self.metadata = [], []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()

    def GenerateStream(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        prompt = request.text or request.messages.messages[0].content
        if prompt == "FULL":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the queue is full, retry later")
        steps, usage = SCRIPTS.get(prompt, ([(0.01, "t")] * request.max_tokens, None))
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            for delay, text in steps:
                time.sleep(delay)
                yield pb.GenerateStreamResponse(text=text)
            yield pb.GenerateStreamResponse(finish_reason=pb.FINISH_REASON_LENGTH, usage=usage)
        finally:
            with self.lock:
                self.in_flight -= 1

    def ListModels(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        return pb.ListModelsResponse(models=[pb.Model(id=MODEL), pb.Model(id="second")])


@contextmanager
def serve_grpc(servicer, port: int = 0):
    """A gRPC server for `servicer` on 127.0.0.1 (`port`, or a free one); yields HOST:PORT.

    A thread-pool server rather than grpc.aio: grpc.aio's one poller hands each event to the loop it belongs
    to, and an aio server's loop beside the bench's (which closes after each run) can hang at shutdown."""
    server = grpc.server(ThreadPoolExecutor(max_workers=16))
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield f"127.0.0.1:{bound}"
    finally:
        server.stop(grace=None).wait(10)


@pytest.fixture
def servicer():
    return ScriptedGeneration()


@pytest.fixture
def target(servicer):
    with serve_grpc(servicer) as address:
        yield address


def _send(config: BenchConfig, prompt: str, output_len: int = 16):
    async def one():
        async with grpc_session(config, time.perf_counter) as session:
            return session.model, await session.send(BenchRequest(prompt, None, output_len), 0.0)

    return asyncio.run(one())


def test_arrivals_give_ttft_itl_and_the_usage_counts(target):
    model, r = _send(BenchConfig(grpc=target), "timed")
    assert model == MODEL and r.ok and r.error is None
    assert 0.14 <= r.ttft < 1.0  # the first text after 0.15 s of scripted sleep
    assert len(r.itl) == 2  # three text messages: a, b, c (the empty one is no arrival)
    assert 0.03 <= r.itl[0] < 0.5 and 0.08 <= r.itl[1] < 0.6
    assert r.e2e >= r.ttft + sum(r.itl)
    assert (r.output_tokens, r.prompt_len) == (4, 7)  # from the last message's usage
    assert r.tpot == pytest.approx((r.e2e - r.ttft) / 3)


def test_without_usage_text_messages_count_and_a_stop_at_once_completes(target):
    _, r = _send(BenchConfig(grpc=target), "no usage")
    assert r.ok and r.output_tokens == 2 and r.prompt_len is None and len(r.itl) == 1
    _, r = _send(BenchConfig(grpc=target), "stops at once")
    assert r.ok and (r.output_tokens, r.prompt_len, r.ttft, r.itl) == (0, 3, None, [])


def test_a_grpc_error_is_a_failed_result_of_its_code(target):
    _, r = _send(BenchConfig(grpc=target), "FULL")
    assert not r.ok and r.error == "gRPC RESOURCE_EXHAUSTED" and r.detail == "the queue is full, retry later"
    _, r = _send(BenchConfig(grpc=target, timeout_s=0.1), "slow")  # --timeout is the call's deadline
    assert not r.ok and r.error == "gRPC DEADLINE_EXCEEDED"


def test_request_fields_and_the_api_key_as_metadata(target, servicer):
    config = BenchConfig(grpc=target, endpoint="chat", api_key="sekrit", temperature=0.5, ignore_eos=True)
    _send(config, "no usage", output_len=9)
    request = servicer.requests[-1]
    assert request.WhichOneof("prompt") == "messages"
    assert [(m.role, m.content) for m in request.messages.messages] == [("user", "no usage")]
    assert (request.model, request.max_tokens, request.temperature, request.ignore_eos) == (MODEL, 9, 0.5, True)
    assert [m.get("authorization") for m in servicer.metadata] == ["Bearer sekrit"] * 2  # ListModels, the call
    _send(BenchConfig(grpc=target, model="given"), "no usage")
    request = servicer.requests[-1]
    assert (request.WhichOneof("prompt"), request.text, request.model) == ("text", "no usage", "given")
    assert "authorization" not in servicer.metadata[-1]


def test_run_bench_over_grpc_caps_concurrency_and_reports_the_protocol(target, servicer):
    config = BenchConfig(grpc=target, max_concurrency=2, warmup=1)
    requests = [BenchRequest(f"prompt {i}", None, 3) for i in range(6)] + [BenchRequest("FULL", None, 3)]
    run = run_bench(config, requests)
    assert run.model == MODEL and len(run.results) == 7 and not run.interrupted and run.warmup_failed == 0
    assert len(servicer.requests) == 8  # the warm-up went the same way
    assert servicer.most_in_flight == 2
    report = build_report(config, DatasetConfig(), run)
    assert (report["protocol"], report["base_url"], report["endpoint"]) == ("grpc", f"grpc://{target}",
                                                                            "/v1/completions")
    assert (report["completed"], report["total_output_tokens"]) == (6, 18)
    assert report["failures"] == {"gRPC RESOURCE_EXHAUSTED": 1}


def test_an_interrupted_run_over_grpc_keeps_what_finished(target):
    def interrupt(result, done, planned):
        if done == 2:
            raise KeyboardInterrupt

    run = run_bench(BenchConfig(grpc=target, max_concurrency=1, warmup=0),
                    [BenchRequest(f"prompt {i}", None, 3) for i in range(6)], on_result=interrupt)
    assert run.interrupted and len(run.results) == 2 and run.duration > 0


def test_an_unreachable_target_fails_every_request_and_names_no_model():
    run = run_bench(BenchConfig(grpc=f"127.0.0.1:{free_port()}", warmup=0), [BenchRequest("x", None, 2)] * 2)
    assert run.model is None and [r.error for r in run.results] == ["gRPC UNAVAILABLE"] * 2


@pytest.mark.parametrize("bad", ["localhost", "localhost:", ":50051", "localhost:0", "localhost:65536",
                                 "localhost:http", "http://localhost:50051", "::1:50051"])
def test_bad_targets_are_config_errors(bad):
    with pytest.raises(ConfigError, match="give HOST:PORT of the server's gRPC API"):
        BenchConfig(grpc=bad).validate()


def test_targets_are_normalized_and_auto_needs_a_server():
    assert normalize_grpc_target(" grpc://localhost:50051/ ") == "localhost:50051"
    assert normalize_grpc_target("[::1]:8001") == "[::1]:8001"
    BenchConfig(grpc="auto").validate()  # a bench stage fills in its server's port
    with pytest.raises(ConfigError, match="no server to bench"):
        run_bench(BenchConfig(grpc="auto"), [])
    assert BenchConfig(url="http://h:1").describe()["protocol"] == "http"


def test_cli_grpc_benches_a_running_server(target, tmp_path, capsys):
    path = tmp_path / "r.json"
    code = main(["bench", "--grpc", target, "--dataset", "random", "--num-prompts", "4", "--input-len", "5",
                 "--output-len", "3", "--max-concurrency", "2", "--quiet", "--json", str(path)])
    assert code == 0
    report = json.loads(path.read_text())
    assert (report["protocol"], report["base_url"], report["model_id"]) == ("grpc", f"grpc://{target}", MODEL)
    assert (report["completed"], report["failed"], report["total_output_tokens"]) == (4, 0, 12)
    assert f"grpc://{target} GenerateStream (/v1/completions fields) over gRPC" in capsys.readouterr().out


@pytest.mark.parametrize("argv, expect", [
    (["--grpc", "auto"], "--grpc auto benches the server that --server SOURCE starts"),
    (["--grpc", "auto", "--url", "http://127.0.0.1:9"], "give --server SOURCE too"),
    (["--grpc", "127.0.0.1:9", "--server", "x"], "give --grpc auto"),
    (["--grpc", "127.0.0.1:9", "--url", "http://127.0.0.1:9"], "give --url or --grpc HOST:PORT, not both"),
    (["--grpc", "127.0.0.1"], "--grpc '127.0.0.1': give HOST:PORT"),
    (["--grpc", "auto", "--server", "x", "--engine", "hf"], "only --engine llmopt serves gRPC"),
    (["--grpc", "127.0.0.1:9", "--offline", "x"], "--url / --server, not both"),
])
def test_cli_grpc_misuse_is_one_line_and_exit_2(argv, expect, capsys):
    assert main(["bench", "--num-prompts", "1", "--quiet", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and expect in err, err


def test_cli_grpc_auto_starts_the_server_with_a_grpc_port(servicer, tmp_path, monkeypatch):
    started = []

    @contextmanager
    def fake_server(spec, status, stats):  # stands in for `llmopt serve SOURCE --grpc-port P`
        command = spec.command(8000)
        started.append(command)
        with serve_grpc(servicer, port=int(command[command.index("--grpc-port") + 1])):
            stats["ready_s"] = 0.5
            yield "http://127.0.0.1:8000"

    monkeypatch.setattr(bench_run, "running_server", fake_server)
    path = tmp_path / "r.json"
    code = main(["bench", "--server", "out/x", "--grpc", "auto", "--dataset", "random", "--num-prompts", "2",
                 "--input-len", "5", "--output-len", "2", "--quiet", "--json", str(path)])
    assert code == 0 and len(started) == 1
    port = started[0][started[0].index("--grpc-port") + 1]
    assert started[0][started[0].index("serve") + 1] == "out/x" and port != "8000"
    report = json.loads(path.read_text())
    assert (report["protocol"], report["base_url"], report["completed"]) == ("grpc", f"grpc://127.0.0.1:{port}", 2)
    assert report["server"]["source"] == "out/x" and report["server"]["ready_s"] == 0.5


def test_the_started_server_gets_a_grpc_port_only_when_asked():
    assert "--grpc-port" not in ServerSpec("out/x").command(8000)
    command = ServerSpec("out/x", grpc_port=8001).command(8000)
    assert command[command.index("--grpc-port") + 1] == "8001" and command[command.index("--port") + 1] == "8000"
    assert ServerSpec("out/x", grpc_port=8001).grpc_target == "127.0.0.1:8001"


def test_wait_grpc_returns_once_the_port_answers_and_reports_a_server_that_exits(servicer, tmp_path):
    log = tmp_path / "log"
    log.write_text("binding the gRPC port\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        with serve_grpc(servicer) as address:
            wait_grpc(proc, address, 5.0, log)
    finally:
        stop(proc, timeout_s=5)
    with pytest.raises(ServerError, match=r"exited with code -15 before its gRPC port .*\n  \| binding the gRPC port"):
        wait_grpc(proc, f"127.0.0.1:{free_port()}", 5.0, log)
