"""Generate the Python stubs of proto/llmopt/v1/generate.proto into stages/grpc_api/ (`make proto`).

grpcio-tools writes `llmopt/v1/generate_pb2.py` and `generate_pb2_grpc.py`, the second importing the first
as `llmopt.v1`; here both land flat in one package and that import becomes relative, so the stubs load as
`llmopt.stages.grpc_api` without a package named after the proto's. The descriptor keeps the proto's own
file name (llmopt/v1/generate.proto), which is what reflection and other languages' stubs see.
tests/stages/serve/rpc/test_stubs.py runs this into a scratch folder and compares it with what is committed.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PROTO = "llmopt/v1/generate.proto"
STUBS = ROOT / "stages" / "grpc_api"
MODULES = ("generate_pb2.py", "generate_pb2_grpc.py")


def generate(out: Path) -> list[Path]:
    """Write the stubs into `out` (a folder that exists); returns their paths."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as scratch:
        code = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"-I{_well_known()}", f"--python_out={scratch}",
                            f"--grpc_python_out={scratch}", str(PROTO_ROOT / PROTO)])
        if code != 0:
            raise SystemExit(f"protoc failed on {PROTO} (exit {code})")
        made = Path(scratch) / Path(PROTO).parent
        paths = []
        for name in MODULES:
            text = (made / name).read_text(encoding="utf-8")
            text = text.replace("from llmopt.v1 import generate_pb2 as", "from . import generate_pb2 as")
            path = out / name
            path.write_text(text, encoding="utf-8")
            paths.append(path)
    return paths


def _well_known() -> str:
    """grpcio-tools' own copy of google/protobuf/*.proto."""
    import grpc_tools

    return str(Path(grpc_tools.__file__).parent / "_proto")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=STUBS, help="folder to write into (default: stages/grpc_api)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
