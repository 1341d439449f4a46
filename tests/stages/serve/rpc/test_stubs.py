"""The committed stubs in stages/grpc_api are what `make proto` writes from proto/llmopt/v1/generate.proto."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]


def test_committed_stubs_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) regenerates the stubs")
    from scripts.gen_proto import MODULES, STUBS, generate

    generate(tmp_path)
    for name in MODULES:
        assert (tmp_path / name).read_text() == (STUBS / name).read_text(), \
            f"stages/grpc_api/{name} is stale: run `make proto` after changing proto/llmopt/v1/generate.proto"


def test_the_stubs_describe_the_proto_file_and_import_each_other_relatively():
    from llmopt.stages.grpc_api import SERVICE, generate_pb2, generate_pb2_grpc

    assert generate_pb2.DESCRIPTOR.name == "llmopt/v1/generate.proto" and generate_pb2.DESCRIPTOR.package == "llmopt.v1"
    assert generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name == SERVICE
    assert "from . import generate_pb2" in (ROOT / "stages/grpc_api/generate_pb2_grpc.py").read_text()
    assert hasattr(generate_pb2_grpc, "GenerationStub") and hasattr(generate_pb2_grpc, "GenerationServicer")
