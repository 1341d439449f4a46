"""run_profile on a tiny dense model and its W4A16 artifact: the report's structure, its arithmetic
(checkable by hand), and the HTML page rendered from it."""
import base64
import json
import re

import pytest

from llmopt.stages.errors import SourceError
from llmopt.stages.profile.html import render_html, write_report
from llmopt.stages.profile.run import manifest_perplexity, run_profile
from llmopt.stages.profile.tables import comparison_table
from tests.stages.profile.conftest import PPL, TINY


def test_every_configured_point_is_measured_or_skipped_with_a_reason(report):
    assert [s["source"] for s in report["sources"]] == [s["source"] for s in report["comparison"]]
    for s in report["sources"]:
        assert [p["prompt_len"] for p in s["prefill"]] == [8, 32]
        assert s["skipped"] == ["prompt length 512: longer than the model's 256 positions"]
        assert [p["batch"] for p in s["decode"]] == [1, 2, 16]
        assert [p["context"] for p in s["decode_context"]] == [8, 64]
        assert all(p["ms"] > 0 for p in s["prefill"] + s["decode"] + s["decode_context"])
        for p in s["prefill"] + s["decode"] + s["decode_context"]:  # every point's spread beside its median
            assert p["ms_min"] <= p["ms_median"] == p["ms"] <= p["ms_max"]
        assert all(p["steps"] == TINY.decode_steps for p in s["decode"] + s["decode_context"])
    json.dumps(report)  # JSON-able as returned


def test_bandwidth_share_is_weight_bytes_over_step_time_over_copy_bandwidth(report):
    copy = report["machine"]["copy"]
    assert copy["bytes_per_s"] == copy["bytes_moved_per_copy"] / copy["seconds_best"]
    for s in report["sources"]:
        r, b1 = s["roofline"], s["decode"][0]
        # the roofline's step is timed back to back; the sweep's batch-1 point is kept beside it
        assert b1["batch"] == 1 and r["weight_bytes"] == s["weights"]["total"] and r["sweep_step_ms"] == b1["ms"]
        assert r["step_ms"] > 0 and r["timing"].startswith(f"{max(TINY.decode_steps, 16)} batch-1 steps back to back")
        by_hand = (r["weight_bytes"] / (r["step_ms"] / 1000)) / copy["bytes_per_s"]
        assert r["bandwidth_share"] == pytest.approx(by_hand, rel=1e-12)
        assert r["copy_bytes_per_s"] == copy["bytes_per_s"]
        row = next(c for c in report["comparison"] if c["source"] == s["source"])
        assert row["bandwidth_share"] == r["bandwidth_share"] and row["decode_tokens_per_s_b1"] == b1["tokens_per_s"]
        # per token at batch 1: the weights and the KV rows of this context, over the token's time
        assert r["kv_bytes_read"] == b1["context"] * s["memory"]["kv_bytes_per_token"] > 0
        assert r["bytes_read_per_token"] == r["weight_bytes"] + r["kv_bytes_read"] and r["ms_per_token"] == r["step_ms"]
        by_hand = (r["bytes_read_per_token"] / (r["ms_per_token"] / 1000)) / copy["bytes_per_s"]
        assert r["read_share"] == pytest.approx(by_hand, rel=1e-12) and r["read_share"] > r["bandwidth_share"]
        by_hand = (r["bytes_read_per_token"] / (b1["ms"] / 1000)) / copy["bytes_per_s"]
        assert r["sweep_read_share"] == pytest.approx(by_hand, rel=1e-12)


def test_per_layer_breakdown_covers_every_layer_and_reports_its_ratio(report):
    for s in report["sources"]:
        for which in ("decode", "prefill"):
            b = s["breakdown"][which]
            names = [r["name"] for r in b["rows"]]
            assert names == ["layer 0", "layer 1", "lm_head"]
            assert b["sum_ms"] == pytest.approx(sum(r["ms"] for r in b["rows"]))
            assert b["ratio"] == pytest.approx(b["sum_ms"] / b["step_ms"])
            assert b["unattributed_ms"] == pytest.approx(b["step_ms"] - b["sum_ms"])
            assert 0 < b["ratio"] <= 1 and b["unattributed_ms"] >= 0 and b["note"] == ""  # disjoint hooks
            assert 0 < len(s["ops"][which]["rows"]) <= TINY.top_ops


def test_w4_uses_its_int4_kernel_and_manifest_perplexity(report):
    base, w4 = report["sources"]
    assert base["model"]["projections"] == {"DenseLinear": 8}
    assert w4["model"]["projections"] == {"W4A16Linear": 8}
    decode_ops = {r["op"] for r in w4["ops"]["decode"]["rows"]}
    assert {"aten::_weight_int4pack_mm_for_cpu", "llmopt::gemv_w4"} & decode_ops  # torch's int4 kernel or ours
    assert w4["weights"]["total"] < base["weights"]["total"] and w4["size_bytes"] < base["size_bytes"]
    assert report["comparison"][0]["perplexity"] is None
    assert report["comparison"][1]["perplexity"] == PPL["after"]


def test_capacity_plan_uses_the_budget_and_measured_decode(report):
    for s in report["sources"]:
        c = s["capacity"]
        assert c["budget_bytes"] == 64 << 20 and c["context"] == 128
        assert c["kv_bytes_per_seq"] == 128 * s["memory"]["kv_bytes_per_token"]
        assert c["max_num_seqs_fit"] == max(0, c["kv_budget_bytes"] // c["kv_bytes_per_seq"])
        assert [r["measured_ms"] for r in c["tradeoff"]] == [p["ms"] for p in s["decode"]]
        assert [r["measured_ms_max"] for r in c["tradeoff"]] == [p["ms_max"] for p in s["decode"]]
        assert c["monotone"] == (c["sweep_problems"] == [])
        assert c["recommended_max_num_seqs"] is None or c["recommended_max_num_seqs"] <= c["max_num_seqs_fit"]


def test_manifest_perplexity_prefers_the_stage_result_then_the_longest_eval():
    evals = {"eval/wiki.test.raw/seqlen2048/windows-2": {"perplexity": 9.0, "windows": 2},
             "eval/wiki.test.raw/seqlen2048/windows-all": {"perplexity": 8.0, "windows": 141},
             "eval/wiki.test.raw/seqlen2048/windows-all/kl-vs-base": {"perplexity": 1.0, "windows": 141}}
    assert manifest_perplexity(evals)["perplexity"] == 8.0
    assert manifest_perplexity({**evals, "perplexity_before_after": PPL})["perplexity"] == PPL["after"]
    assert manifest_perplexity({"size_bytes": 3}) is None


def test_the_comparison_shows_each_evaluation_set_a_stage_measured(report):
    """A stage's before/after on several sets: WikiText-2 in the perplexity column, the others beside it."""
    sets = {"wikitext2": {"before": 10.0, "after": 12.5, "increase_pct": 25.0},
            "code": {"before": 3.0, "after": 3.3, "increase_pct": 10.0}}
    found = manifest_perplexity({"perplexity_before_after": {**PPL, "text": "wikitext2", "sets": sets}})
    assert (found["perplexity"], found["sets"]) == (12.5, {"code": 3.3})
    assert manifest_perplexity({"perplexity_before_after": PPL})["sets"] == {}  # written before the sets
    base, w4 = report["comparison"]
    rows = [{**base, "perplexity_sets": {}}, {**w4, "perplexity_sets": {"code": 3.3}}]
    table = comparison_table({**report, "comparison": rows})
    assert table.columns[2:4] == ["perplexity", "perplexity code"] and [r[3] for r in table.rows] == ["-", "3.300"]
    old = comparison_table({**report, "comparison": [{k: v for k, v in r.items() if k != "perplexity_sets"}
                                                     for r in report["comparison"]]})
    assert "perplexity code" not in old.columns  # a report written before the sets


def test_html_report_has_its_sections_and_embedded_plots(report, tmp_path):
    write_report(report, tmp_path / "r.json", tmp_path / "out" / "r.html")
    page = (tmp_path / "out" / "r.html").read_text()
    assert json.loads((tmp_path / "r.json").read_text())["sources"][1]["roofline"] == report["sources"][1]["roofline"]
    sections = re.findall(r'<section id="([^"]+)">', page)
    assert sections == ["summary", "comparison", "machine", "latency", "roofline", "source-0", "source-1", "config"]
    anchors = re.findall(r'<h3 id="([^"]+)">', page)
    assert len(anchors) == len(set(anchors))
    for key in ("prefill", "decode", "roofline", "breakdown-decode", "breakdown-prefill", "ops-decode", "memory",
                "capacity"):
        assert f"source-1-{key}" in anchors
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 2 + len(report["sources"])  # latency, roofline, one breakdown per source
    assert all(base64.b64decode(img).startswith(b"\x89PNG") for img in images)
    assert "sum / step" in page and "bandwidth share" in page and "recommended --max-num-seqs" in page
    assert "http://" not in page and "https://" not in page  # self-contained
    assert render_html(report) == page


def test_a_missing_source_fails_before_measuring(tiny_sources):
    with pytest.raises(SourceError, match="no such file"):
        run_profile([tiny_sources[0], "/no/such/model"], TINY)


def test_run_profile_restores_the_callers_thread_count(tiny_sources):
    import torch

    torch.set_num_threads(2)
    run_profile([tiny_sources[0]], TINY.with_options(prompt_lens=(8,), batch_sizes=(1,), context_lens=(8,)))
    assert torch.get_num_threads() == 2
