import ast
from pathlib import Path

import pytest

from llmopt.stages.bench.gate import Bound, broken_bounds, compare, direction, parse_fail_on, parse_fraction
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
