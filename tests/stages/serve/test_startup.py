"""Start-up (stages/serve/startup.py and what it times): the phase report, the layout cache through the
loader (a second start reads what the first built, and serves the same tokens), the warm-up deferred until ready,
the artifact's hashes read once, and the "serving on" line with the report (JSON under --log-json)."""
import json
import logging
import time
import warnings

import pytest
import torch

from llmopt.stages.artifact import Artifact
from llmopt.stages.quantize.config import QuantizeConfig
from llmopt.stages.quantize.run import run_quantize
from llmopt.stages.serve.build import build_engine, warm_up_in_background
from llmopt.stages.serve.engine.config import EngineConfig, SamplingParams
from llmopt.stages.serve.startup import StartupReport, process_age
from tests.helpers import write_hf_dir

ENGINE = dict(block_size=4, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64)
LOAD_PHASES = ["artifact", "tokenizer", "weights", "layouts", "kv_cache", "engine"]


@pytest.fixture(scope="module")
def w4_artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    write_hf_dir(root / "base", hidden=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = QuantizeConfig(method="rtn", eval_windows=0, scheme="W4A16", group_size=32, embeddings="int8")
        return run_quantize(str(root / "base"), root / "w4", cfg).path


def test_the_report_times_phases_from_the_process_start():
    age = process_age()
    assert age is None or age > 0
    report = StartupReport(start=time.perf_counter() - 1.0)
    with report.phase("layouts"):  # the load thread may record its phases before the imports end
        pass
    report.mark("imports")
    with report.phase("layouts"):
        sum(range(10000))
    with report.phase("layouts"):  # a phase met twice adds up
        pass
    report.notes["layouts"] = "hit (3 layouts)"
    report.ready()
    data = json.loads(json.dumps(report.as_dict()))
    assert list(data["phases"]) == ["imports", "layouts"]  # start-up order, whatever order they were met in
    assert data["phases"]["imports"]["wall_s"] >= 1.0 and data["ready_s"] >= 1.0 and data["cpu_s"] > 0
    assert data["notes"] == {"layouts": "hit (3 layouts)"}
    line = report.summary()
    assert line.startswith("ready in ") and "imports 1." in line and line.endswith("layouts: hit (3 layouts)")


def _greedy(engine) -> list[int]:
    return engine.generate(["the quick brown"], SamplingParams(max_tokens=6, temperature=0))[0].token_ids


@pytest.mark.parametrize("backend", ["cpu-native", "cpu-torch"])
def test_a_second_start_reads_the_layouts_the_first_built(w4_artifact, isolated_cache, backend):
    from llmopt.kernels import cpu_native

    if backend == "cpu-native" and not cpu_native.gemv_available():
        pytest.skip("native GEMV needs a C compiler and an AVX-512 CPU")
    outputs, notes = [], []
    for _ in range(2):
        report = StartupReport()
        engine = build_engine(str(w4_artifact), EngineConfig(**ENGINE), "cpu", torch.float32, backend, startup=report)
        assert list(report.phases) == LOAD_PHASES
        notes.append(report.notes["layouts"])
        outputs.append(_greedy(engine))
    assert notes[0].startswith("miss") and notes[1].startswith("hit"), notes
    assert outputs[0] == outputs[1]
    assert len(list((isolated_cache / "layouts").glob("*.bin"))) == 1


def test_a_damaged_layout_file_is_rebuilt_at_start(w4_artifact, isolated_cache):
    build_engine(str(w4_artifact), EngineConfig(**ENGINE), "cpu", torch.float32, "cpu-torch")
    path = next((isolated_cache / "layouts").glob("*.bin"))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x55
    path.write_bytes(bytes(data))
    report = StartupReport()
    engine = build_engine(str(w4_artifact), EngineConfig(**ENGINE), "cpu", torch.float32, "cpu-torch", startup=report)
    assert report.notes["layouts"].startswith("rebuilt"), report.notes
    fresh = StartupReport()
    again = build_engine(str(w4_artifact), EngineConfig(**ENGINE), "cpu", torch.float32, "cpu-torch", startup=fresh)
    assert fresh.notes["layouts"].startswith("hit") and _greedy(engine) == _greedy(again)


def test_deferred_warmup_serves_the_same_tokens_before_during_and_after_it(w4_artifact, isolated_cache):
    now = build_engine(str(w4_artifact), EngineConfig(**ENGINE), "cpu", torch.float32, "cpu-torch")
    later = build_engine(str(w4_artifact), EngineConfig(**ENGINE), "cpu", torch.float32, "cpu-torch",
                         defer_warmup=True)
    assert not later.runner.prebuild  # left for the warm-up
    assert _greedy(now) == _greedy(later)  # served before it (the cache's pages fault in as used)
    thread = warm_up_in_background(later)
    assert _greedy(now) == _greedy(later)
    thread.join(60)
    assert not thread.is_alive() and later.runner.prebuild
    assert _greedy(now) == _greedy(later)


def test_work_deferred_until_ready_runs_once_then_and_a_failure_does_not_stop_the_rest(caplog):
    report, ran = StartupReport(), []

    def broken():
        raise OSError("no")

    report.on_ready(lambda: ran.append("first"))
    report.on_ready(broken)
    report.on_ready(lambda: ran.append("last"))
    assert ran == []
    with caplog.at_level(logging.WARNING, logger="llmopt.serve"):
        report.ready()
    assert ran == ["first", "last"] and "broken failed (OSError: no)" in caplog.text
    report.ready()
    assert ran == ["first", "last"]


def test_artifact_hashes_are_read_once_then_trusted_while_unchanged(w4_artifact, isolated_cache, monkeypatch):
    import llmopt.stages.artifact as artifact

    hashed = []
    real = artifact.sha256_file
    monkeypatch.setattr(artifact, "sha256_file", lambda p, *a: hashed.append(p.name) or real(p, *a))
    Artifact.open(w4_artifact)
    assert "model.safetensors" in hashed
    hashed.clear()
    Artifact.open(w4_artifact)
    assert hashed == []  # the record matches every file's size, mtime and inode
    Artifact.open(w4_artifact, full=True)
    assert "model.safetensors" in hashed  # `llmopt inspect --verify` hashes anyway
    hashed.clear()
    config = w4_artifact / "config.json"
    config.write_text(config.read_text().replace('"', '"', 1))  # same bytes, new mtime
    Artifact.open(w4_artifact)
    assert hashed  # changed stat: hashed again (and still right)


def test_a_modified_weight_file_is_caught_despite_the_record(w4_artifact, isolated_cache, tmp_path):
    import shutil

    from llmopt.stages.errors import ArtifactError

    copy = tmp_path / "copy"
    shutil.copytree(w4_artifact, copy)
    Artifact.open(copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256 does not match"):
        Artifact.open(copy)


def test_the_serving_line_carries_the_report(w4_artifact, isolated_cache, caplog):
    from llmopt.stages.serve.http import ServerConfig, create_app
    from tests.stages.serve.http.conftest import running

    for log_json in (False, True):
        report = StartupReport()
        report.mark("imports")

        def loader():
            return build_engine(str(w4_artifact), EngineConfig(**ENGINE), "cpu", torch.float32, "cpu-torch",
                                startup=report)

        app = create_app(ServerConfig(log_json=log_json), loader=loader, startup=report)
        with caplog.at_level(logging.INFO, logger="llmopt.serve"), running(app) as server, server.client() as client:
            deadline = time.time() + 60
            while client.get("/health").status_code != 200 and time.time() < deadline:
                time.sleep(0.02)
        lines = [r.getMessage() for r in caplog.records if "serving on" in r.getMessage() or '"ready"' in r.getMessage()]
        caplog.clear()
        assert lines, "no ready line"
        if log_json:
            data = json.loads(lines[-1])
            assert data["event"] == "ready" and data["url"].startswith("http://")
            assert list(data["startup"]["phases"]) == ["imports", "http", *LOAD_PHASES]
            assert data["startup"]["ready_s"] > 0 and data["startup"]["notes"]["layouts"]
        else:
            assert "model loaded; serving on http://" in lines[-1] and "layouts" in lines[-1] and "ready in" in lines[-1]
