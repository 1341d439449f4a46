"""`llmopt bench summary DIR`: one row per run and concurrency, ratios to the baseline at the same concurrency."""
import json

from llmopt.cli.main import main


def _write(directory, name, c, tok_s, server=None, protocol=None):
    report = {"server": server, **({"protocol": protocol} if protocol else {}), "completed": 16, "failed": 0, "output_throughput": tok_s, "request_throughput": tok_s / 64,
              "median_ttft_ms": 100.0, "p99_ttft_ms": 200.0, "median_tpot_ms": 20.0, "median_itl_ms": 19.0,
              "median_e2el_ms": 1400.0, "dataset": "sharegpt", "num_prompts": 16, "output_len": 64, "request_rate": "inf"}
    (directory / f"{name}-c{c}.json").write_text(json.dumps(report))


def test_summary_computes_ratios_per_concurrency(tmp_path, capsys):
    for c, base, ours in ((1, 14.8, 50.7), (16, 15.3, 193.0)):
        _write(tmp_path, "hf-base", c, base)
        _write(tmp_path, "llmopt-base", c, ours, {"engine": "llmopt", "ready_s": 1.234, "peak_rss_bytes": 900 * 2**20})
    _write(tmp_path, "llmopt-grpc", 1, 60.4, protocol="grpc")
    (tmp_path / "notes.json").write_text("{}")  # not NAME-cC.json: left alone
    assert main(["bench", "summary", str(tmp_path), "--baseline", "hf-base"]) == 0
    text = (tmp_path / "summary.md").read_text()
    assert capsys.readouterr().out.strip() == text.strip()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| hf-") or line.startswith("| llmopt")]
    # a report without a protocol (an older one, or vLLM's) ran over HTTP
    assert [(r[0], r[1], r[2], r[-3]) for r in rows] == [("| hf-base", "http", "1", "1.0x"),
                                                         ("| hf-base", "http", "16", "1.0x"),
                                                         ("| llmopt-base", "http", "1", "3.4x"),
                                                         ("| llmopt-base", "http", "16", "12.6x"),
                                                         ("| llmopt-grpc", "grpc", "1", "4.1x")]
    # a server the bench started: its start-up time and peak memory; a --url one has neither
    assert [r[-2:] for r in rows] == [["-", "- |"]] * 2 + [["1.23", "900 |"]] * 2 + [["-", "- |"]]
    assert "sharegpt, 16 prompts, max_tokens 64 (ignore_eos), request rate inf" in text


def test_summary_without_reports_is_one_line_and_without_the_baseline_has_no_ratios(tmp_path, capsys):
    assert main(["bench", "summary", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no NAME-cC.json reports" in err
    _write(tmp_path, "llmopt-base", 1, 50.0)
    assert main(["bench", "summary", str(tmp_path), "--baseline", "hf-base"]) == 0
    text = (tmp_path / "summary.md").read_text()
    assert "| llmopt-base | http | 1 | 16/0 | 50.0 |" in text and text.count(" - |") == 3
    assert "no run named hf-base (--baseline): no ratios" in text
