"""schemathesis against the server's own OpenAPI spec: generated requests, valid and invalid,
never get a 5xx. Bounded here (LLMOPT_FUZZ_EXAMPLES per operation and mode, default 15);
`make fuzz` sets it (200), which also runs the schemathesis CLI's examples, coverage and fuzzing phases
against the live server for up to LLMOPT_FUZZ_MAX_TIME seconds (default 300)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from .conftest import serve

EXAMPLES = int(os.environ.get("LLMOPT_FUZZ_EXAMPLES", "15"))
LONG_RUN = "LLMOPT_FUZZ_EXAMPLES" in os.environ  # make fuzz
MAX_TIME = int(os.environ.get("LLMOPT_FUZZ_MAX_TIME", "300"))


@pytest.fixture(scope="module")
def fuzz_server(model_dir):
    # A short model length bounds the work of any generated request; a long queue keeps a 503
    # (which would count as a 5xx) out of a sequential run.
    with serve(model_dir, engine_overrides={"max_model_len": 32, "max_num_seqs": 8}, max_queued_requests=4096,
               max_body_bytes=64 * 1024) as running_server:
        yield running_server


def operations(base_url: str):
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_generated_request_gets_a_server_error(fuzz_server, mode):
    ops = operations(fuzz_server.base_url)
    assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    for op in ops:
        if mode is GenerationMode.NEGATIVE and op.method.upper() == "GET":
            continue  # nothing in these GETs can be made invalid (any string is a model name)
        @given(case=op.as_strategy(mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            case.call_and_validate(base_url=fuzz_server.base_url, checks=[not_a_server_error], timeout=30)

        check()
    assert fuzz_server.state.healthy


@pytest.mark.skipif(not LONG_RUN, reason="the schemathesis CLI pass runs under make fuzz (LLMOPT_FUZZ_EXAMPLES set)")
def test_the_schemathesis_cli_phases_find_no_server_error(fuzz_server):
    command = [sys.executable, "-m", "schemathesis.cli", "run", fuzz_server.base_url + "/openapi.json",
               "--checks", "not_a_server_error", "--max-examples", str(EXAMPLES), "--max-time", str(MAX_TIME),
               "--phases", "examples,coverage,fuzzing", "--workers", "1", "--suppress-health-check", "all"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=MAX_TIME + 120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert fuzz_server.state.healthy
