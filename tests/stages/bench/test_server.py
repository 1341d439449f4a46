"""--server: start a real server subprocess on a tiny model, bench it, stop it; clear errors when it fails."""
import json
import subprocess
import sys
import time

import pytest

from llmopt.stages.errors import ConfigError

from llmopt.cli.main import main
from llmopt.stages.bench.server import (ServerError, ServerSpec, free_port, peak_rss_bytes, running_server, stop,
                                        wait_healthy)


def _serve_available() -> bool:
    try:
        import llmopt.stages.serve.http.server  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("engine", [
    pytest.param("llmopt", marks=pytest.mark.skipif(not _serve_available(), reason="llmopt serve not built yet")),
    "hf",
])
def test_server_option_benches_a_real_server(engine, tiny_hf, tmp_path, capsys):
    report_path = tmp_path / "r.json"
    code = main(["bench", "--server", str(tiny_hf[0]), "--engine", engine, "--dataset", "random", "--input-len", "6",
                 "--output-len", "5", "--ignore-eos", "--num-prompts", "4", "--max-concurrency", "2", "--quiet",
                 "--server-timeout", "120", "--json", str(report_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(report_path.read_text())
    assert (report["completed"], report["failed"]) == (4, 0)
    assert report["total_output_tokens"] == 20  # usage from the server: exactly max_tokens with ignore_eos
    assert report["server"]["engine"] == engine and report["mean_ttft_ms"] > 0
    # what the person running it notices: time to the first /health 200 and the peak memory (VmHWM)
    assert 0 < report["server"]["ready_s"] < 120
    assert report["server"]["peak_rss_bytes"] > 50 * 2**20  # python + torch at least
    assert "server ready at http://127.0.0.1:" in captured.err


def test_a_server_that_dies_is_reported_with_its_last_lines():
    spec = ServerSpec("/no/such/model", startup_timeout_s=60)
    with pytest.raises(ServerError) as failure:
        with running_server(spec):
            pytest.fail("the server should not have started")
    message = str(failure.value)
    assert "exited with code 2 before answering /health" in message
    assert "/no/such/model" in message.split("last lines of its output:")[1]


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path):
    log = tmp_path / "log"
    log.write_text("loading...\nstill loading\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        started = time.monotonic()
        with pytest.raises(ServerError, match=r"did not answer /health within 0.5 s.*\n  \| loading\.\.\.\n  \| still"):
            wait_healthy(proc, f"http://127.0.0.1:{free_port()}", 0.5, log, "llmopt")
        assert time.monotonic() - started < 5
    finally:
        assert stop(proc, timeout_s=5) == -15  # SIGTERM was enough


def test_unknown_engine_is_a_config_error(capsys):
    assert main(["bench", "--server", "x", "--engine", "vllm"]) == 2
    assert "--engine vllm: use llmopt, hf or llama-server" in capsys.readouterr().err


def test_llama_server_runs_the_given_binary_on_the_gguf(tmp_path, monkeypatch):
    from llmopt.stages.source import resolve

    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("LLAMA_SERVER", str(binary))
    command = ServerSpec("smollm2-135m", engine="llama-server", args=("-t", "2")).command(8123)
    assert command == [str(binary), "-m", str(resolve("smollm2-135m").path), "--host", "127.0.0.1",
                       "--port", "8123", "-t", "2"]


def test_llama_server_errors_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "missing"))
    assert main(["bench", "--server", "smollm2-135m", "--engine", "llama-server", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "$LLAMA_SERVER=" in err and "not an executable file" in err and "Traceback" not in err
    monkeypatch.delenv("LLAMA_SERVER")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["bench", "--server", "smollm2-135m", "--engine", "llama-server", "--quiet"]) == 2
    assert "no llama-server binary; set $LLAMA_SERVER" in capsys.readouterr().err
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="llama-server loads a .gguf file"):
        ServerSpec(str(model_dir), engine="llama-server").command(8000)


def test_peak_rss_reads_this_process_and_none_for_a_gone_one():
    import os

    assert peak_rss_bytes(os.getpid()) > 10 * 2**20
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert peak_rss_bytes(proc.pid) is None


def test_the_bench_server_has_no_drain_grace_unless_serve_args_set_one():
    spec = ServerSpec("out/x", args=("--drain-grace", "2"))
    command = spec.command(8000)
    grace = [i for i, word in enumerate(command) if word == "--drain-grace"]
    assert [command[i + 1] for i in grace] == ["0", "2"]  # ours first: the user's, given last, wins
    assert "--drain-grace" not in ServerSpec("out/x", engine="hf").command(8000)


def _grpc_serve_available() -> bool:
    try:
        from llmopt.stages.serve.rpc import start_grpc  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _grpc_serve_available(), reason="llmopt serve --grpc-port not built yet")
def test_grpc_auto_benches_a_real_server_over_its_grpc_port(tiny_hf, tmp_path, capsys):
    report_path = tmp_path / "r.json"
    code = main(["bench", "--server", str(tiny_hf[0]), "--grpc", "auto", "--dataset", "random", "--input-len", "6",
                 "--output-len", "5", "--ignore-eos", "--num-prompts", "4", "--max-concurrency", "2", "--quiet",
                 "--server-timeout", "120", "--json", str(report_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(report_path.read_text())
    assert (report["protocol"], report["completed"], report["failed"]) == ("grpc", 4, 0), report["errors"]
    assert report["base_url"].startswith("grpc://127.0.0.1:") and report["model_id"]
    assert report["total_output_tokens"] == 20 and report["total_input_tokens"] > 0  # usage of the last messages
    assert ", gRPC at 127.0.0.1:" in captured.err
