"""`llmopt profile --acceptance DIR`: the GPU check's PASS/FAIL table from report dicts that pass every
bar, that miss one bar each, and from missing or failing reports; the exit status follows."""
import copy
import json

import pytest

from llmopt.cli.main import main
from llmopt.stages.profile.acceptance import BARS, FAIL, NOT_RUN, PASS, REPORTS, evaluate, load_reports, read_junit


def kernel_row(m: int, n: int, w4_us: float, w8_us: float, dense_us: float = 40.0, copy: float = 4e12) -> dict:
    k = 4096
    us = {"dense": dense_us, "w4a16": w4_us, "w8a16": w8_us, "w8a8": 50.0}
    nbytes = {"dense": 2 * n * k, "w4a16": n * k // 2, "w8a16": n * k, "w8a8": n * k}
    return {"k": k, "n": n, "m": m, "us": us, "bytes": nbytes,
            "share": {s: nbytes[s] / (us[s] * 1e-6) / copy for s in us}, "speedup": {s: dense_us / us[s] for s in us}}


def engine(layers: int, rows: list[tuple[int, float, float]]) -> dict:
    """rows: (batch, tokens/s, share)."""
    return {"layers": layers, "rows": [{"batch": b, "tokens_per_s": t, "share": s, "step_ms": b / t * 1e3}
                                       for b, t, s in rows]}


def junit(tests: int, failures: int = 0, errors: int = 0, skipped: int = 0) -> dict:
    return {"tests": tests, "failures": failures, "errors": errors, "skipped": skipped}


def passing() -> dict:
    """Reports that clear every bar (a W4A16 GEMV at 80% of 4 TB/s on 4096x14336 takes about 9.2 us)."""
    kernels = [kernel_row(m, n, w4, w8) for n in (4096, 14336)
               for m, w4, w8 in ((1, 9.2, 16.0), (16, 15.0, 20.0), (64, 38.0, 40.0))]
    greedy = {"machine": {"device": "cuda"}, "dtype": "torch.bfloat16", "tokens": 32, "margin": 0.03, "exact": 7,
              "passed": True, "rows": [{"same": 32, "ok": True}] * 7 + [{"same": 10, "ok": True, "gap": 0.01}]}
    return {"kernel_tests": junit(120, skipped=8), "kernels": {"matmuls": kernels},
            "engine_bf16": engine(32, [(1, 190.0, 0.70), (32, 5000.0, 0.66), (128, 17000.0, 0.62)]),
            "engine_w4a16": engine(32, [(1, 500.0, 0.50), (32, 12000.0, 0.5), (128, 30000.0, 0.4)]),
            "bench_c1": {"completed": 8, "failed": 0, "output_throughput": 150.0},
            "bench_c32": {"completed": 64, "failed": 0, "output_throughput": 3000.0},
            "greedy": greedy, "graphs": junit(21, skipped=0)}


def statuses(reports: dict) -> list[str]:
    return [r["status"] for r in evaluate(reports)]


def test_reports_that_clear_every_bar_pass_every_row():
    rows = evaluate(passing())
    assert [r["status"] for r in rows] == [PASS] * 13
    assert rows[1]["check"] == "W4A16 M=1 4096x14336: share of copy bandwidth"  # the wide matrix
    assert rows[6]["check"].startswith("engine 32 layers bf16 batch 1:") and "batch 128" in rows[7]["check"]


def _set(reports: dict, path: str, value) -> dict:
    """A copy of reports with the value at path ('kernels.matmuls.9.us.w4a16') replaced."""
    out = copy.deepcopy(reports)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    return out


WIDE_M1, WIDE_M16, WIDE_M64 = 3, 4, 5  # the 4096x14336 rows of `passing()`'s kernel table


@pytest.mark.parametrize("path, value, failing_row", [
    (f"kernels.matmuls.{WIDE_M1}.share.w4a16", BARS["w4a16_m1_share"] - 0.01, 1),
    (f"kernels.matmuls.{WIDE_M1}.speedup.w4a16", BARS["w4a16_m1_speedup"] - 0.01, 2),
    (f"kernels.matmuls.{WIDE_M16}.speedup.w4a16", 1.99, 3),
    (f"kernels.matmuls.{WIDE_M64}.speedup.w4a16", 0.99, 4),
    (f"kernels.matmuls.{WIDE_M1}.share.w8a16", 0.59, 5),
    ("engine_bf16.rows.0.share", 0.64, 6),
    ("engine_bf16.rows.2.share", 0.59, 7),
    ("engine_w4a16.rows.0.tokens_per_s", 2.49 * 190.0, 8),
    ("bench_c1.failed", 1, 9),
    ("bench_c32.completed", 0, 10),
    ("greedy.passed", False, 11),
    ("graphs.failures", 1, 12),
    ("kernel_tests.errors", 1, 0),
])
def test_each_bar_missed_fails_its_row_only(path, value, failing_row):
    got = statuses(_set(passing(), path, value))
    assert got == [FAIL if i == failing_row else PASS for i in range(13)]


def test_a_smaller_matrix_below_the_bar_does_not_count():
    assert statuses(_set(passing(), "kernels.matmuls.0.speedup.w4a16", 0.1)) == [PASS] * 13


def test_missing_reports_fail_their_rows_and_graphs_may_be_not_run():
    rows = evaluate({})
    assert [r["status"] for r in rows] == [FAIL] * 12 + [NOT_RUN]
    assert rows[0]["value"] == "no kernel-tests.xml (the part failed or timed out)"
    assert statuses(_set(passing(), "graphs", junit(1, skipped=1)))[-1] == NOT_RUN  # the CUDA test skipped
    no_m16 = _set(passing(), "kernels.matmuls", [r for r in passing()["kernels"]["matmuls"] if r["m"] != 16])
    assert [r["value"] for r in evaluate(no_m16)][3] == "no row for M=16"


def _write(folder, reports: dict) -> None:
    for key, value in reports.items():
        path = folder / REPORTS[key]
        if path.suffix == ".xml":
            attrs = " ".join(f'{k}="{v}"' for k, v in value.items())
            path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest" {attrs}/></testsuites>')
        else:
            path.write_text(json.dumps(value))


def test_read_junit_and_load_reports(tmp_path):
    _write(tmp_path, passing())
    (tmp_path / REPORTS["greedy"]).write_text("{not json")
    assert read_junit(tmp_path / REPORTS["kernel_tests"]) == junit(120, skipped=8)
    reports = load_reports(tmp_path)
    assert reports["greedy"] is None and reports["engine_bf16"] == passing()["engine_bf16"]


def test_the_command_exits_1_on_a_failed_row_and_prints_the_table(tmp_path, capsys):
    _write(tmp_path, passing())
    out = tmp_path / "verdict.json"
    assert main(["profile", "--acceptance", str(tmp_path), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["passed"] is True
    _write(tmp_path, {"bench_c32": {"completed": 60, "failed": 4}})
    assert main(["profile", "--acceptance", str(tmp_path), "--json", str(out)]) == 1
    failed = [r for r in json.loads(out.read_text())["rows"] if r["status"] == FAIL]
    assert [r["value"] for r in failed] == ["60 completed, 4 failed, 0.0 output tok/s"]
    assert "FAILED: 1 of 13 rows" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("argv, expect", [
    (["--acceptance", "/no/such/folder"], "no such folder"),
    (["SRC", "--acceptance", "."], "reads reports: give no SOURCE"),
    (["--acceptance", ".", "--synthetic", "tiny"], "give one of them"),
])
def test_acceptance_misuse_is_one_line(argv, expect, capsys):
    assert main(["profile", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err
