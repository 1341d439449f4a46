"""`llmopt serve --data-parallel N`: replicas in processes of their own, each on its own cores, behind the
router in this process; /metrics with a replica label, /health per replica, SIGTERM stops them all."""
from __future__ import annotations

import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmopt.stages.errors import ConfigError
from llmopt.stages.route.app import with_label
from llmopt.stages.serve.data_parallel import core_sets, replica_options
from tests.helpers import write_chat_model_dir
from tests.stages.serve.http.conftest import CHAT_TEMPLATE
from tests.stages.serve.http.serve_process import serve_process


def test_cores_are_shared_out_or_refused_when_they_do_not_fit():
    assert core_sets([0, 1, 2, 3], 2, None) == [[0, 1], [2, 3]]
    assert core_sets([4, 5, 6], 3, 1) == [[4], [5], [6]]
    with pytest.raises(ConfigError, match="needs 4 CPUs"):
        core_sets([0, 1], 2, 2)
    options = {"host": "0.0.0.0", "port": 8000, "data_parallel": 2, "threads": None, "max_model_len": 128,
               "api_key": None}
    assert replica_options(options, 9001, 2) == {"max_model_len": 128, "host": "127.0.0.1", "port": 9001, "threads": 2}


def test_a_label_goes_into_every_sample_line():
    assert with_label('x{a="1"} 2.0', "replica", "0") == 'x{a="1",replica="0"} 2.0'
    assert with_label("x_total 3", "replica", "1") == 'x_total{replica="1"} 3'


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two replicas need a core each")
def test_two_replicas_behind_one_endpoint(tmp_path):
    model = write_chat_model_dir(tmp_path / "tiny", CHAT_TEMPLATE)
    with serve_process(model, "--data-parallel", "2", "--router-policy", "round-robin", tmp_path=tmp_path) as server:
        with server.client() as client:
            health = client.get("/health").json()
            assert [r["healthy"] for r in health["replicas"]] == [True, True]
            for _ in range(4):
                body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 3, "ignore_eos": True}
                assert client.post("/v1/completions", json=body).status_code == 200
            text = client.get("/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}  # valid text format throughout
        served = [s for s in families["llmopt:request_finished"].samples if s.name == "llmopt:request_finished_total"]
        assert {s.labels["replica"] for s in served} == {"0", "1"}
        per_replica = {r: sum(s.value for s in served if s.labels["replica"] == r) for r in ("0", "1")}
        assert per_replica == {"0": 2, "1": 2}, served  # round-robin
        server.terminate()
        assert server.proc.wait(timeout=90) == 0
