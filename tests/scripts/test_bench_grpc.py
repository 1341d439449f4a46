"""scripts/bench_grpc.py: its command line, the alternation of the protocols, the bench commands it runs, the
server's CPU time, and the table from a run's numbers. The run itself serves for minutes: `make bench-grpc`."""
import importlib.util
import os
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_grpc.py"
spec = importlib.util.spec_from_file_location("bench_grpc", SCRIPT)
bench_grpc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_grpc)


def test_rounds_alternate_which_protocol_goes_first():
    assert [bench_grpc.order(r) for r in range(3)] == [("http", "grpc"), ("grpc", "http"), ("http", "grpc")]


def test_both_protocols_get_the_same_load(tmp_path):
    args = bench_grpc.parse_args(["a", "synthetic-tiny", "--rounds", "5", "--num-prompts", "32"])
    assert args.sources == ["a", "synthetic-tiny"] and args.rounds == 5 and args.concurrency == 16
    http = bench_grpc.bench_command("http", 8000, 50051, args, tmp_path, "h.json")
    grpc = bench_grpc.bench_command("grpc", 8000, 50051, args, tmp_path, "g.json")
    assert http[http.index("--url") + 1] == "http://127.0.0.1:8000" and grpc[grpc.index("--grpc") + 1] == "127.0.0.1:50051"
    strip = lambda cmd: [a for a in cmd if a not in ("--url", "--grpc", "http://127.0.0.1:8000", "127.0.0.1:50051",
                                                      "h.json", "g.json")]  # noqa: E731
    assert strip(http) == strip(grpc) and "--ignore-eos" in http and http[http.index("--num-prompts") + 1] == "32"
    assert bench_grpc.serve_args("out/x", tmp_path) == ("out/x", [])
    with pytest.raises(SystemExit):
        bench_grpc.parse_args(["a", "--rounds", "0"])


def test_cpu_seconds_reads_this_process():
    before = bench_grpc.cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))
    assert bench_grpc.cpu_seconds(os.getpid()) > before


def test_table_gives_medians_and_grpcs_ratio_to_http():
    def run(itl, cpu):
        return {"median_itl_ms": itl, "median_tpot_ms": itl, "median_ttft_ms": 100.0, "output_throughput": 50.0,
                "server_cpu_ms_per_token": cpu}
    runs = {"http": [run(10.0, 2.0), run(12.0, 2.2), run(11.0, 2.1)],
            "grpc": [run(9.0, 1.8), run(10.0, 2.0), run(11.0, 1.9)]}
    text = bench_grpc.table(runs)
    assert "| http | 11.00 | 11.00 | 100.00 | 50.00 | 2.10 |" in text
    assert "| grpc | 10.00 | 10.00 | 100.00 | 50.00 | 1.90 |" in text
    assert "| grpc / http | 0.909x | 0.909x | 1.000x | 1.000x | 0.905x |" in text
    assert "- grpc round 2: 10.00, 10.00, 100.00, 50.00, 2.00" in text
