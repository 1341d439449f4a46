"""scripts/bench_ci.py (make bench-ci, the gate .ci/run runs after the tests): the order it runs the two sides in,
the medians it gates on, its table and its memory bound. The servers themselves run in CI, not here."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_ci.py"
spec = importlib.util.spec_from_file_location("bench_ci", SCRIPT)
bench_ci = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_ci)


def _report(tput, ttft, tpot, rss_mib):
    return {"completed": 12, "failed": 0, "dataset": "sharegpt", "output_throughput": tput, "median_ttft_ms": ttft,
            "median_tpot_ms": tpot, "server": {"ready_s": 3.0, "peak_rss_bytes": int(rss_mib * 2**20)}}


def test_the_sides_alternate_round_by_round():
    assert bench_ci.order(2, "hf") == [("llmopt", 1), ("hf", 1), ("llmopt", 2), ("hf", 2)]


def test_the_gate_reads_medians_and_the_highest_peak_rss():
    rounds = [_report(100.0, 50.0, 20.0, 700), _report(60.0, 90.0, 30.0, 720), _report(110.0, 40.0, 25.0, 690)]
    med = bench_ci.median_report(rounds)
    assert (med["output_throughput"], med["median_ttft_ms"], med["median_tpot_ms"]) == (100.0, 50.0, 25.0)
    assert med["completed"] == 12 and med["dataset"] == "sharegpt"
    assert bench_ci.peak_rss_mib(med) == 720 and med["rounds"]["output_throughput"] == [100.0, 60.0, 110.0]


def test_table_gives_each_ratio_beside_its_bound():
    ours = bench_ci.median_report([_report(400.0, 50.0, 20.0, 700), _report(420.0, 60.0, 22.0, 710)])
    base = bench_ci.median_report([_report(40.0, 500.0, 200.0, 1500), _report(44.0, 520.0, 220.0, 1490)])
    bounds = bench_ci.bound_texts(["output_throughput=4"], ["p50_ttft_ms=0.5,median_tpot_ms=0.5"])
    assert bounds == {"output_throughput": ">= 4", "median_ttft_ms": "<= 0.5", "median_tpot_ms": "<= 0.5"}
    lines = bench_ci.table(ours, base, "hf", bounds, 900).splitlines()
    assert lines[2] == "| output_throughput | 400.0, 420.0 | 40.0, 44.0 | 410.0 | 42.0 | 9.762 | >= 4 |"
    assert lines[3].endswith("| 55.0 | 510.0 | 0.108 | <= 0.5 |")
    assert lines[5] == "| server peak RSS MiB | | | 710 | 1,500 | | <= 900 |"


def test_the_memory_bound_fails_above_it_and_when_unmeasured():
    assert bench_ci.rss_problem(_report(1.0, 1.0, 1.0, 800), 900) is None
    assert "800 MiB is above the bound 700" in bench_ci.rss_problem(_report(1.0, 1.0, 1.0, 800), 700)
    assert "not measured" in bench_ci.rss_problem({"completed": 1, "server": {}}, 700)
    assert bench_ci.rss_problem({"completed": 1}, None) is None
