"""`llmopt profile --soak / --kernels / --synthetic`: what replaces the sweep, on tiny models built in
the tests: the soak frees every block, the matmul step adds up its shapes, the synthetic engine reports
each batch; and the ways to ask for them wrongly."""
import json
from types import SimpleNamespace

import pytest

from llmopt.cli.main import main
from llmopt.stages.profile.config import MODE_PRESETS, ProfileConfig
from llmopt.stages.profile.matmuls import SCHEMES, step_shapes
from llmopt.stages.profile.soak import soak_report, Soak
from llmopt.stages.serve.model import ModelSpec
from tests.helpers import write_hf_dir


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny64")
    write_hf_dir(path, hidden=64)
    return str(path)


def _run(argv, tmp_path) -> tuple[int, dict]:
    path = tmp_path / "report.json"
    code = main(["profile", *argv, "--threads", "1", "--json", str(path)])
    return code, json.loads(path.read_text())


def test_soak_frees_every_block_and_counts_its_aborts(tiny_hf, tmp_path, capsys):
    code, report = _run([str(tiny_hf[0]), "--soak", "40", "--soak-in-flight", "4"], tmp_path)
    assert code == 0 and report["passed"] and report["problems"] == []
    assert report["requests"] == 40 and report["aborted"] == 8  # every fifth, after its first token
    assert report["free_blocks"] == report["total_blocks"] and report["running"] == report["waiting"] == 0
    assert [n for n, _ in report["rss_mib"]] == list(range(0, 41, 4))  # the reference, then every 40 // 10
    assert "free blocks" in " ".join(capsys.readouterr().out.split())


def test_a_soak_that_leaks_fails():
    stats = SimpleNamespace(num_free_blocks=60, num_blocks=64, num_running=0, num_waiting=0)
    soak = Soak(SimpleNamespace(stats=lambda: stats), [], None, 4)
    soak.readings = [(0, 100 * 2**20, 10), (40, 140 * 2**20, 10)]
    report = soak_report("m", ProfileConfig(soak=40), soak, dict(soak.counts), 1.0)
    assert not report["passed"] and report["rss_growth_mib"] == 40
    assert report["problems"] == ["blocks still in use: 4 of 64",
                                  "RSS grew 40.0 MiB after the warm-up, its trend over 2 readings (bound 32 MiB)"]


def _report(rss_mib):
    stats = SimpleNamespace(num_free_blocks=64, num_blocks=64, num_running=0, num_waiting=0)
    soak = Soak(SimpleNamespace(stats=lambda: stats), [], None, 4)
    soak.readings = [(4 * i, int(r * 2**20), 10) for i, r in enumerate(rss_mib)]
    return soak_report("m", ProfileConfig(soak=40), soak, dict(soak.counts), 1.0)


def test_one_late_first_allocation_is_not_a_leak():
    report = _report([100] + [133] * 10)  # a prompt length the warm-up never drew, then flat
    assert report["passed"] and report["rss_growth_mib"] == 0 and report["rss_change_mib"] == 33


def test_a_steady_leak_fails_even_with_noise():
    report = _report([100 + 4 * i + (3 if i % 3 == 0 else 0) for i in range(11)])  # 4 MiB every 4 requests
    assert not report["passed"] and 36 <= report["rss_growth_mib"] <= 44


def test_step_shapes_merge_equal_projections():
    spec = ModelSpec("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                     num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5)
    assert step_shapes(spec, 30) == {"q/o": (576, 576, 60), "k/v": (576, 192, 60), "gate/up": (576, 1536, 60),
                                     "down": (1536, 576, 30), "lm_head": (576, 49152, 1)}  # 211 matmuls


def test_kernels_step_is_the_sum_of_its_shapes(tiny64, tmp_path):
    code, report = _run([tiny64, "--kernels", "--batch-sizes", "1,2", "--repeats", "1"], tmp_path)
    assert code == 0 and report["layers"] == 2 and set(report["accuracy"]) == set(SCHEMES)
    for rows in ("1", "2"):
        for scheme in SCHEMES:
            total = sum(s["us"][rows][scheme] * s["calls_per_step"] for s in report["shapes"].values())
            assert report["step_us"][rows][scheme] == pytest.approx(total)
    assert report["accuracy"]["fp32"]["vs_weight"] < 1e-5 < report["accuracy"]["w4a16"]["vs_weight"]


def test_synthetic_engine_reports_each_batch(tmp_path, capsys):
    code, report = _run(["--synthetic", "tiny", "--layers", "2", "--dtype", "fp32", "--batch-sizes", "1,3",
                         "--decode-context", "20", "--decode-steps", "6"], tmp_path)
    assert code == 0 and [r["batch"] for r in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert row["steps"] >= 3 and row["tokens_per_s"] > 0 and row["share"] > 0
        assert row["bytes_per_step"] > 2 * 2 * 256 * 512 * 4  # at least two layers' MLP weights in fp32
    assert "copy bandwidth" in capsys.readouterr().out


def test_presets_fill_what_is_not_given():
    assert ProfileConfig.from_options({"synthetic": "tiny"}).batch_sizes == MODE_PRESETS["synthetic"]["batch_sizes"]
    assert ProfileConfig.from_options({"synthetic": "tiny", "batch_sizes": "1,2"}).batch_sizes == (1, 2)
    assert ProfileConfig.from_options({"kernels": True}).repeats == 7 and ProfileConfig().repeats == 3


@pytest.mark.parametrize("argv, expect", [
    (["TINY", "TINY", "--soak", "10"], "--soak measures one model: give one SOURCE (got 2)"),
    (["TINY", "--synthetic", "tiny"], "--synthetic builds its own model: give no SOURCE"),
    (["--synthetic", "llama3-70b"], "--synthetic llama3-70b: choose one of llama3-8b, tiny"),
    (["TINY", "--soak", "10", "--kernels"], "--soak and --kernels: give one of them"),
    (["TINY", "--soak", "0"], "--soak must be at least 1"),
    (["TINY", "--soak", "10", "--html", "r.html"], "--html is the sweep's report; --soak writes --json only"),
    (["TINY", "--kernels"], "input sizes must be multiples of the int4 group size 64"),
])
def test_bad_measurements_give_one_line_and_exit_2(argv, expect, tiny_hf, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["profile", *(str(tiny_hf[0]) if a == "TINY" else a for a in argv)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expect in err, err
