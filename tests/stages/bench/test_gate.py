import ast
from pathlib import Path

import pytest

from llmopt.stages.bench.gate import (Bound, RatioBound, broken_bounds, check_ratios, compare, direction, parse_fail_on,
                                      parse_fraction, parse_ratios, regression_bound)
from llmopt.stages.bench.plot import write_plot
from llmopt.stages.errors import ConfigError

REPORT = {"p99_ttft_ms": 734.2, "output_throughput": 41.5, "failed": 0, "request_goodput": None}


def test_fail_on_parses_and_names_the_broken_bound():
    bounds = parse_fail_on(" p99_ttft_ms>500 , output_throughput<50,failed>=1")
    assert bounds == [Bound("p99_ttft_ms", ">", 500.0), Bound("output_throughput", "<", 50.0),
                      Bound("failed", ">=", 1.0)]
    assert broken_bounds(bounds, REPORT) == ["p99_ttft_ms = 734.2 > 500", "output_throughput = 41.5 < 50"]
    assert broken_bounds(parse_fail_on("p99_ttft_ms>1000,output_throughput<=41"), REPORT) == []
    assert "not available" in broken_bounds(parse_fail_on("request_goodput<1"), REPORT)[0]
    assert parse_fail_on("") == [] and parse_fail_on(None) == []
    assert parse_fail_on("p50_ttft_ms>5") == [Bound("median_ttft_ms", ">", 5.0)]  # p50_X is the report's median_X


@pytest.mark.parametrize("text", ["p99_ttft_ms", "p99_ttft_ms>>5", "p99_ttft_ms>fast", "nonsense>1", "x>1e"])
def test_bad_fail_on_is_a_config_error(text):
    with pytest.raises(ConfigError, match="--fail-on"):
        parse_fail_on(text)


def test_directions_and_fractions():
    assert [direction(m) for m in ("output_throughput", "p99_itl_ms", "failed", "total_input_tokens")] == [1, -1, -1, None]
    assert parse_fraction("10%") == pytest.approx(0.1) and parse_fraction("0.25") == 0.25 and parse_fraction("0%") == 0
    for bad in ("10", "-5%", "x"):
        with pytest.raises(ConfigError):
            parse_fraction(bad)


def test_compare_verdicts():
    base = {"output_throughput": 100.0, "p99_ttft_ms": 50.0, "failed": 0, "duration": 10.0, "mean_itl_ms": None}
    new = {"output_throughput": 95.0, "p99_ttft_ms": 80.0, "failed": 0, "duration": 12.0, "mean_itl_ms": 3.0}
    rows = {r.metric: r for r in compare(base, new, 0.1)}
    assert rows["output_throughput"].verdict == "worse" and rows["output_throughput"].change == pytest.approx(-0.05)
    assert rows["p99_ttft_ms"].verdict == "REGRESSION"
    assert rows["failed"].verdict == "same" and rows["duration"].verdict == "" and rows["mean_itl_ms"].verdict == "n/a"
    assert compare(base, {**new, "failed": 1}, 0.1, ["failed"])[0].verdict == "REGRESSION"
    with pytest.raises(ConfigError, match="unknown metric"):
        compare(base, new, 0.1, ["speed"])


def test_compare_without_a_regression_bound_never_says_regression():
    rows = {r.metric: r for r in compare({"p99_ttft_ms": 50.0}, {"p99_ttft_ms": 80.0}, None)}
    assert rows["p99_ttft_ms"].verdict == "worse" and rows["p99_ttft_ms"].ratio == pytest.approx(1.6)
    assert compare({"failed": 0}, {"failed": 2}, None, ["failed"])[0].ratio is None  # no ratio from a base of 0
    assert compare({"median_ttft_ms": 5.0}, {"median_ttft_ms": 5.0}, 0.1, ["p50_ttft_ms"])[0].metric == "median_ttft_ms"


def test_ratio_bounds_parse_from_repeats_and_comma_lists():
    bounds = parse_ratios(["output_throughput=3, request_throughput=2x", "p50_ttft_ms=1.0"], "--min-ratio")
    assert bounds == [RatioBound("output_throughput", "--min-ratio", 3.0),
                      RatioBound("request_throughput", "--min-ratio", 2.0),
                      RatioBound("median_ttft_ms", "--min-ratio", 1.0)]  # p50_X is the report's median_X
    assert parse_ratios(None, "--max-ratio") == [] and parse_ratios([""], "--max-ratio") == []


@pytest.mark.parametrize("text, says", [("speed=3", "unknown metric speed"), ("output_throughput=abc", "not a number"),
                                        ("output_throughput", "write METRIC=RATIO"), ("=3", "unknown metric"),
                                        ("output_throughput=0", "positive"), ("output_throughput=-2", "positive"),
                                        ("output_throughput=inf", "positive")])
def test_bad_ratio_bound_is_a_config_error(text, says):
    with pytest.raises(ConfigError, match=f"--max-ratio '{text}': .*{says}"):
        parse_ratios([text], "--max-ratio")


def test_ratio_checks_hold_and_break():
    base = {"output_throughput": 20.0, "median_ttft_ms": 50.0}
    new = {"output_throughput": 65.0, "median_ttft_ms": 60.0}
    bounds = parse_ratios(["output_throughput=3"], "--min-ratio") + parse_ratios(["p50_ttft_ms=1"], "--max-ratio")
    throughput, ttft = check_ratios(bounds, base, new)
    assert throughput.holds and throughput.ratio == pytest.approx(3.25)
    assert not ttft.holds and str(ttft) == "median_ttft_ms 50 -> 60 = 1.2x, above --max-ratio 1"
    short = check_ratios(parse_ratios(["output_throughput=4"], "--min-ratio"), base, new)[0]
    assert str(short) == "output_throughput 20 -> 65 = 3.25x, below --min-ratio 4"
    empty = check_ratios(bounds[1:], base, {**new, "median_ttft_ms": None})[0]  # no completed request: fails
    assert not empty.holds and "null" in str(empty)


@pytest.mark.parametrize("base, new, says", [({}, {"failed": 1}, "b.json has no failed"),
                                             ({"failed": 1}, {}, "n.json has no failed"),
                                             ({"failed": 0}, {"failed": 1}, "b.json has failed = 0"),
                                             ({"failed": None}, {"failed": 1}, "b.json has failed = null")])
def test_ratio_of_a_missing_or_zero_base_is_a_config_error(base, new, says):
    with pytest.raises(ConfigError, match=f"--min-ratio failed: {says}"):
        check_ratios([RatioBound("failed", "--min-ratio", 1.0)], base, new, ("b.json", "n.json"))


def test_max_regression_applies_when_given_or_when_no_ratio_bound_is():
    ratios = [RatioBound("output_throughput", "--min-ratio", 3.0)]
    assert regression_bound(None, []) == pytest.approx(0.1)
    assert regression_bound(None, ratios) is None
    assert regression_bound("5%", ratios) == pytest.approx(0.05)


def test_plot_of_a_run_without_completions(tmp_path):
    report = {"errors": ["connect error: x"], "ttfts": [None], "itls": [[]], "e2els": [None], "output_lens": [0],
              "start_times": [0.0], "duration": 0.01, "completed": 0, "failed": 1}
    write_plot(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_bench_imports_nothing_of_the_serve_engine():
    # every dotted name an import reaches (`from ..serve.x import y`, `from .. import serve`, `import a.serve`);
    # the bench's own `server` module (it starts `llmopt serve` as a subprocess) is not the engine
    for path in (Path(__file__).parents[3] / "stages" / "bench").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module or ''}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any("serve" in name.split(".") for name in names), f"{path.name} imports {names}"


def test_urls_and_slos():
    from llmopt.stages.bench.config import normalize_url, parse_slo

    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/chat/completions"):
        assert normalize_url(url) == "http://h:1"
    assert parse_slo("ttft_ms=500, tpot_ms=50,e2e_ms=3000") == {"ttft_ms": 500, "tpot_ms": 50, "e2el_ms": 3000}
    for bad in ("ttft_ms=0", "ttft_ms", "latency=5"):
        with pytest.raises(ConfigError, match="--slo"):
            parse_slo(bad)
