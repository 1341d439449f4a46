"""/metrics through prometheus_client: vLLM's names under `llmopt:`, a model_name on every series, the
runtime collectors, multiprocess mode; and the Grafana dashboard and alert rules name only what it exports."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from llmopt.stages.serve.engine.config import SpeculativeConfig

from .conftest import serve
from .prom_text import samples, value

DEPLOY = Path(__file__).parents[4] / "deploy"
BODY = {"model": "tiny", "prompt": "twelve twelve twelve twelve", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                "offset", "inf", "nan"}


def test_metrics_come_from_prometheus_client_with_vllms_series_and_a_model_name(server):
    with server.client() as client:
        client.post("/v1/completions", json=BODY)
        response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    kinds = {f.name: f.type for f in text_string_to_metric_families(text)}
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total"):
        assert kinds["llmopt:" + name] == "histogram", name
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio", "server_ready",
                 "cache_config_info"):
        assert kinds["llmopt:" + name] == "gauge", name
    for name in ("prompt_tokens", "generation_tokens", "request_finished", "num_preemptions",
                 "prefix_cache_queries", "prefix_cache_hits", "requests_rejected"):
        assert kinds["llmopt:" + name] == "counter", name  # the parser drops `_total` from a counter's family
    assert value(text, "process_resident_memory_bytes") > 0 and "python_gc_collections" in kinds
    ours = [s for s in samples(text) if s.name.startswith("llmopt:")]
    assert ours and all(s.labels.get("model_name") == "tiny" for s in ours)
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds", "time_to_first_token_seconds"):
        assert value(text, f"llmopt:{name}_count") >= 1
        assert value(text, f"llmopt:{name}_bucket", le="+Inf") == value(text, f"llmopt:{name}_count")
    assert value(text, "llmopt:iteration_tokens_total_count") >= 1 and value(text, "llmopt:iteration_tokens_total_sum") > 0
    assert value(text, "llmopt:request_finished_total", finished_reason="length") >= 1
    assert value(text, "llmopt:cache_config_info", block_size="4", num_blocks="256", cache_dtype="float32",
                 enable_prefix_caching="True") == 1


def test_iteration_tokens_count_each_step_in_vllms_buckets():
    from llmopt.stages.serve.engine.engine import ITERATION_TOKEN_BUCKETS, IterationTokens

    counts = IterationTokens()
    for n in (1, 8, 9, 20000):
        counts.observe(n)
    assert counts.counts[0] == 1 and counts.counts[1] == 1 and counts.counts[2] == 1 and counts.counts[-1] == 1
    assert counts.sum == 20018 and len(counts.counts) == len(ITERATION_TOKEN_BUCKETS) + 1


def test_each_app_has_its_own_registry():
    import prometheus_client

    from llmopt.stages.serve.http.metrics import Scrape, ServerMetrics

    a, b = (ServerMetrics(name, lambda: Scrape(None, {}, False)) for name in ("a", "b"))
    a.series("http").ttft.observe(0.5)
    b.series("http")
    assert value(a.render().decode(), "llmopt:time_to_first_token_seconds_count", model_name="a") == 1
    assert value(b.render().decode(), "llmopt:time_to_first_token_seconds_count", model_name="b") == 0
    assert b"llmopt:" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)


MULTIPROCESS = """
import sys
from llmopt.stages.serve.http.metrics import Scrape, ServerMetrics
metrics = ServerMetrics("m", lambda: Scrape(None, {}, True))
http = metrics.series("http")
http.ttft.observe(0.5)
http.generation_tokens.inc(3)
if sys.argv[1] == "render":
    sys.stdout.write(metrics.render().decode())
"""


def test_multiprocess_mode_sums_every_process_in_the_directory(tmp_path):
    env = os.environ | {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    run = [sys.executable, "-c", MULTIPROCESS]
    subprocess.run(run + ["observe"], env=env, check=True, timeout=120)  # another process: a rank, a worker
    text = subprocess.run(run + ["render"], env=env, check=True, timeout=120, capture_output=True, text=True).stdout
    assert value(text, "llmopt:time_to_first_token_seconds_count", model_name="m") == 2
    assert value(text, "llmopt:generation_tokens_total", model_name="m") == 6
    assert value(text, "llmopt:server_ready", model_name="m") == 1  # read live, once, by the serving process
    assert value(text, "process_resident_memory_bytes") > 0


def test_a_multiprocess_dir_that_is_not_a_directory_is_one_clear_error(tmp_path, monkeypatch):
    import pytest

    from llmopt.stages.errors import ConfigError
    from llmopt.stages.serve.http.prometheus import multiprocess_dir

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="not a directory"):
        multiprocess_dir()


def metric_names(expr: str) -> set[str]:
    """The series a PromQL expression selects: identifiers that are not functions, keywords or labels."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)  # label matchers, ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    names = re.findall(r"(?<![\w:.$])([a-zA-Z_:][\w:]*)\b(?!\s*\()", expr)
    return {n for n in names if n.lower() not in PROMQL_WORDS}


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana/llmopt.json").read_text())


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_promql_names_are_found():
    expr = ('histogram_quantile(0.99, sum by (le, model_name) (rate(llmopt:ttft_bucket{x=~"$i"}[5m]))) / '
            'clamp_min(up offset 5m, 1) and on (instance) process_open_fds > bool 0.5')
    assert metric_names(expr) == {"llmopt:ttft_bucket", "up", "process_open_fds"}


def test_every_dashboard_panel_and_alert_rule_names_a_series_the_server_exports(model_dir):
    with serve(model_dir, {"speculative": SpeculativeConfig("ngram", 3)}) as spec, spec.client() as client:
        client.post("/v1/completions", json=BODY | {"max_tokens": 30})
        text = client.get("/metrics").text
    exported = {s.name for s in samples(text)}
    panels = {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard()["panels"]}
    alerts = {r["alert"]: [r["expr"]] for r in alert_rules()}
    assert {"LlmoptHighErrorRate", "LlmoptHighTimeToFirstToken", "LlmoptQueueGrowing", "LlmoptKVCacheFull"} <= set(alerts)
    for title, exprs in (panels | alerts).items():
        names = set().union(*map(metric_names, exprs))
        assert names and names <= exported, f"{title}: {names - exported} not exported"
    plotted = {n for exprs in panels.values() for e in exprs for n in metric_names(e)}
    families = {f.name for f in text_string_to_metric_families(text) if f.name.startswith("llmopt:")}
    unplotted = {f for f in families if not any(n == f or n.startswith(f + "_") for n in plotted)}
    assert not unplotted, f"the dashboard plots no panel of {unplotted}"


def test_the_dashboard_imports_as_it_is():
    board = dashboard()
    assert board["id"] is None and board["uid"] and board["schemaVersion"] >= 36
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "instance", "model_name"} <= variables
    ids, cells = set(), set()
    for panel in board["panels"]:
        assert panel["id"] not in ids and panel["type"] in {"stat", "timeseries", "table"}
        ids.add(panel["id"])
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs)
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"}
            assert used <= variables, f"{panel['title']}: {used - variables}"


def test_the_scrape_config_loads_the_alert_rules():
    config = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    assert [(DEPLOY / "prometheus" / f).is_file() for f in config["rule_files"]] == [True]
    assert config["scrape_configs"][0]["metrics_path"] == "/metrics"
    for rule in alert_rules():
        assert rule["alert"].startswith("Llmopt") and rule["labels"]["severity"] in {"warning", "critical"}


def test_a_shared_prefix_bench_hits_the_prefix_cache(model_dir, tmp_path):
    """`llmopt bench --dataset shared-prefix` against the real server: after each group's first question, the
    rest find its prefix's blocks cached (the server's own prefix_cache_hits_total, in tokens)."""
    from llmopt.cli.main import main

    with serve(model_dir) as server:
        code = main(["bench", "--url", server.base_url, "--dataset", "shared-prefix:2,16", "--num-prompts", "8",
                     "--input-len", "2", "--output-len", "2", "--max-concurrency", "1", "--warmup", "0", "--quiet",
                     "--json", str(tmp_path / "report.json")])
        with server.client() as client:
            text = client.get("/metrics").text
    assert code == 0
    queries, hits = value(text, "llmopt:prefix_cache_queries_total"), value(text, "llmopt:prefix_cache_hits_total")
    assert queries > 8 * 16 and hits >= 6 * 16  # 6 of 8 prompts find at least a 16-token block of their prefix


def test_per_sequence_series_carry_the_protocol_they_came_by():
    from llmopt.stages.serve.http.metrics import Scrape, ServerMetrics

    metrics = ServerMetrics("m", lambda: Scrape(None, {}, True))
    metrics.series("grpc").generation_tokens.inc(2)
    metrics.series("http").generation_tokens.inc(5)
    text = metrics.render().decode()
    assert value(text, "llmopt:generation_tokens_total", model_name="m", protocol="grpc") == 2
    assert value(text, "llmopt:generation_tokens_total", model_name="m", protocol="http") == 5
    assert metrics.series("grpc") is metrics.series("grpc")
    with pytest.raises(ValueError, match="unknown protocol"):
        metrics.series("ftp")
