"""--server: start a real server subprocess on a tiny model, bench it, stop it; clear errors when it fails."""
import json
import subprocess
import sys
import time

import pytest

from llmopt.cli.main import main
from llmopt.stages.bench.server import ServerError, ServerSpec, free_port, running_server, stop, wait_healthy


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
    assert "--engine vllm: use llmopt or hf" in capsys.readouterr().err


def test_the_bench_server_has_no_drain_grace_unless_serve_args_set_one():
    spec = ServerSpec("out/x", args=("--drain-grace", "2"))
    command = spec.command(8000)
    grace = [i for i, word in enumerate(command) if word == "--drain-grace"]
    assert [command[i + 1] for i in grace] == ["0", "2"]  # ours first: the user's, given last, wins
    assert "--drain-grace" not in ServerSpec("out/x", engine="hf").command(8000)
