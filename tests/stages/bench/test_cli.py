"""`llmopt bench` and `llmopt bench compare` end to end against a stub server on a loopback port."""
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from llmopt.cli import bench_view
from llmopt.cli.main import main
from tests.stages.bench.stub import free_port, serve_stub

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def stub_url():
    with serve_stub(ttft_s=0.02, gap_s=0.005) as url:
        yield url


def _bench(url, tmp_path, *extra):
    report = tmp_path / "report.json"
    argv = ["bench", "--url", url, "--dataset", "random", "--num-prompts", "6", "--input-len", "5",
            "--output-len", "4", "--max-concurrency", "3", "--quiet", "--json", str(report), *extra]
    return main(argv), report


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error:")
    return err


def test_bench_writes_a_vllm_compatible_report(stub_url, tmp_path, capsys):
    code, path = _bench(stub_url, tmp_path, "--plot", str(tmp_path / "plot.png"), "--slo", "ttft_ms=10000")
    assert code == 0
    report = json.loads(path.read_text())
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms",
                "p99_ttft_ms", "mean_tpot_ms", "p90_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms",
                "p99_e2el_ms", "input_lens", "output_lens", "ttfts", "itls", "errors", "duration"):
        assert key in report, key
    assert report["completed"] == 6 and report["failed"] == 0 and report["model_id"] == "stub"
    assert report["total_output_tokens"] == 24 and report["total_input_tokens"] == 30  # usage from the server
    assert report["goodput_completed"] == 6 and report["request_goodput"] == report["request_throughput"]
    assert 20 <= report["median_ttft_ms"] < 2000 and all(len(gaps) == 3 for gaps in report["itls"])
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "output throughput" in out and "TTFT" in out


def test_fail_on_exit_codes_both_ways(stub_url, tmp_path, capsys):
    assert _bench(stub_url, tmp_path, "--fail-on", "p99_ttft_ms>100000,output_throughput<0.001")[0] == 0
    capsys.readouterr()
    assert _bench(stub_url, tmp_path, "--fail-on", "p99_ttft_ms>100000,output_throughput<100000")[0] == 1
    err = capsys.readouterr().err
    assert "fail-on: output_throughput =" in err and "< 100000" in err and "p99_ttft_ms" not in err


def test_failures_are_counted_by_status(stub_url, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "output_len": 3}) for p in ("ok one", "FAIL two", "ok three")))
    code, path = _bench(stub_url, tmp_path, "--dataset", f"jsonl:{data}", "--num-prompts", "3", "--warmup", "0")
    report = json.loads(path.read_text())
    assert code == 0 and (report["completed"], report["failed"]) == (2, 1)
    assert report["failures"] == {"HTTP 500": 1}
    assert "HTTP 500" in capsys.readouterr().out


def test_unreachable_url_reports_failure_counts(tmp_path, capsys):
    code, path = _bench(f"http://127.0.0.1:{free_port()}", tmp_path)
    captured = capsys.readouterr()
    assert code == 1  # nothing was measured
    assert "Traceback" not in captured.err + captured.out
    report = json.loads(path.read_text())
    assert (report["completed"], report["failed"], report["failures"]) == (0, 6, {"connect error": 6})
    assert "every request failed (connect error)" in captured.err


@pytest.mark.parametrize("argv, expect", [
    (["--fail-on", "p99_ttft_ms=>5"], "--fail-on 'p99_ttft_ms=>5': write METRIC>VALUE"),
    (["--fail-on", "p98_ttft_ms>5"], "unknown metric p98_ttft_ms"),
    (["--slo", "ttft=5"], "--slo 'ttft=5': write KEY=MS"),
    (["--slo", "ttft_ms=fast"], "not a number"),
    (["--request-rate", "-1"], "--request-rate '-1'"),
    (["--dataset", "sonnet"], "--dataset 'sonnet'"),
    (["--dataset", "jsonl:/no/such.jsonl"], "no such JSON lines file"),
    (["--dataset", "shared-prefix:8"], "give GROUPS,PREFIX_LEN"),
    (["--endpoint", "embeddings"], "--endpoint embeddings"),
])
def test_bad_options_give_one_line_and_exit_2(argv, expect, capsys):
    assert main(["bench", "--url", "http://127.0.0.1:9", *argv]) == 2
    assert expect in _one_error_line(capsys)


def test_url_or_server_is_required(capsys):
    assert main(["bench"]) == 2
    assert "give --url URL of a running server, or --server SOURCE" in _one_error_line(capsys)
    assert main(["bench", "--url", "localhost:8000"]) == 2
    assert "give the server's base URL" in _one_error_line(capsys)


def _report(path: Path, **metrics) -> Path:
    base = {"completed": 100, "failed": 0, "output_throughput": 100.0, "request_throughput": 2.0,
            "p99_ttft_ms": 50.0, "mean_tpot_ms": 20.0, "dataset": "random", "num_prompts": 100}
    path.write_text(json.dumps(base | metrics))
    return path


def test_compare_exit_codes_both_ways(tmp_path, capsys):
    base = _report(tmp_path / "base.json")
    slower = _report(tmp_path / "slower.json", output_throughput=85.0, p99_ttft_ms=52.0)
    faster = _report(tmp_path / "faster.json", output_throughput=150.0, p99_ttft_ms=30.0)
    assert main(["bench", "compare", str(base), str(faster)]) == 0
    assert "no regression beyond 10%" in capsys.readouterr().out
    assert main(["bench", "compare", str(base), str(slower), "--max-regression", "10%"]) == 1
    captured = capsys.readouterr()
    assert "regression: output_throughput 100 -> 85 (-15.0%, bound 10%)" in captured.err
    assert "p99_ttft_ms" not in captured.err  # +4% latency is within the bound
    assert main(["bench", "compare", str(base), str(slower), "--max-regression", "20%"]) == 0
    latency = _report(tmp_path / "latency.json", p99_ttft_ms=60.0)  # higher latency is worse
    assert main(["bench", "compare", str(base), str(latency)]) == 1
    assert "regression: p99_ttft_ms 50 -> 60" in capsys.readouterr().err
    failing = _report(tmp_path / "failing.json", failed=3, completed=97)
    assert main(["bench", "compare", str(base), str(failing), "--metric", "failed"]) == 1


def test_compare_bad_input_is_one_line(tmp_path, capsys):
    base = _report(tmp_path / "base.json")
    assert main(["bench", "compare", str(base), str(tmp_path / "none.json")]) == 2
    assert "no such report file" in _one_error_line(capsys)
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert main(["bench", "compare", str(base), str(tmp_path / "bad.json")]) == 2
    assert "not a bench report" in _one_error_line(capsys)
    assert main(["bench", "compare", str(base), str(base), "--max-regression", "ten"]) == 2
    assert "--max-regression 'ten'" in _one_error_line(capsys)


def test_compare_ratio_bounds_pass_and_fail(tmp_path, capsys):
    base = _report(tmp_path / "hf.json", output_throughput=20.0, request_throughput=1.0, median_ttft_ms=50.0)
    new = _report(tmp_path / "new.json", output_throughput=65.0, request_throughput=2.5, median_ttft_ms=40.0,
                  p99_ttft_ms=90.0)  # +80% p99 TTFT: no regression gate unless --max-regression is given
    gate = ["bench", "compare", str(base), str(new), "--max-ratio", "p50_ttft_ms=1.0"]
    assert main([*gate, "--min-ratio", "output_throughput=3,request_throughput=2"]) == 0
    captured = capsys.readouterr()
    assert "ratio bounds hold: output_throughput 20 -> 65 = 3.25x, meets --min-ratio 3" in captured.out
    assert "ratio bound" in captured.out and "3.25x" in captured.out and captured.err == ""
    assert main([*gate, "--min-ratio", "output_throughput=3", "--min-ratio", "request_throughput=3"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "ratio: request_throughput 1 -> 2.5 = 2.5x, below --min-ratio 3"
    assert main([*gate, "--min-ratio", "output_throughput=3", "--max-regression", "10%"]) == 1
    assert capsys.readouterr().err.startswith("regression: p99_ttft_ms 50 -> 90")
    assert main(["bench", "compare", str(base), str(new), "--max-ratio", "p50_ttft_ms=0.5", "--metric", "failed"]) == 1
    captured = capsys.readouterr()
    assert "median_ttft_ms" in captured.out  # a bounded metric stays in the table that --metric narrows
    assert captured.err.strip() == "ratio: median_ttft_ms 50 -> 40 = 0.8x, above --max-ratio 0.5"


@pytest.mark.parametrize("bound, says", [
    ("speed=3", "--min-ratio 'speed=3': unknown metric speed"),
    ("output_throughput=abc", "--min-ratio 'output_throughput=abc': 'abc' is not a number"),
    ("output_throughput", "--min-ratio 'output_throughput': write METRIC=RATIO"),
    ("output_throughput=0", "--min-ratio 'output_throughput=0': the ratio NEW/BASE must be a positive"),
    ("mean_itl_ms=1", "--min-ratio mean_itl_ms: base.json has no mean_itl_ms"),
    ("failed=1", "--min-ratio failed: base.json has failed = 0, so NEW/BASE is undefined")])
def test_compare_bad_ratio_bound_is_one_line(tmp_path, capsys, bound, says):
    base = _report(tmp_path / "base.json")
    assert main(["bench", "compare", str(base), str(base), "--min-ratio", bound]) == 2
    assert says in _one_error_line(capsys)


def test_interrupt_prints_the_partial_report(stub_url, tmp_path, monkeypatch, capsys):
    @contextmanager
    def interrupting(total, quiet=False):
        def on_result(result, done, planned):
            if done == 2:
                raise KeyboardInterrupt

        yield on_result

    monkeypatch.setattr(bench_view, "live_progress", interrupting)
    code, path = _bench(stub_url, tmp_path, "--max-concurrency", "1")
    assert code == 130
    report = json.loads(path.read_text())
    assert report["interrupted"] is True and report["completed"] == 2 and report["planned"] == 6
    captured = capsys.readouterr()
    assert "2 / 6" in captured.out and "partial report of 2 finished of 6 requests" in captured.err


def _foreground_sigint():
    """SIGINT as a foreground process gets it. A test run started in the background (`pytest &`,
    nohup) hands its children SIGINT ignored, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_in_a_real_process_prints_the_partial_report(stub_url, tmp_path):
    data = tmp_path / "slow.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "output_len": 2}) for p in ["fast"] * 2 + ["SLOW"] * 40))
    env = dict(os.environ, COLUMNS="200")
    proc = subprocess.Popen([sys.executable, "-m", "llmopt.cli.main", "bench", "--url", stub_url, "--dataset",
                             f"jsonl:{data}", "--num-prompts", "42", "--max-concurrency", "1", "--warmup", "0",
                             "--quiet", "--json", str(tmp_path / "r.json")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_foreground_sigint)
    assert "requests to" in proc.stderr.readline()  # the load starts now
    time.sleep(1.5)  # a few requests finish (the slow ones take ~0.5 s each)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["interrupted"] is True and 0 < report["completed"] < 42
    assert "completed / planned" in out and "partial report" in err and "Traceback" not in err

