"""`make fuzz`: the schemathesis CLI (examples, coverage and fuzzing phases) against a live
`llmopt serve` app on a tiny random model, failing on any 5xx response.

    python scripts/fuzz_http.py [--max-examples 200] [--max-time 300]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-examples", type=int, default=200)
    parser.add_argument("--max-time", type=int, default=300, help="seconds for the whole run")
    args = parser.parse_args()

    import torch

    from tests.helpers import write_hf_dir
    from tests.stages.serve.http.conftest import CHAT_TEMPLATE, serve

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        _, tok = write_hf_dir(Path(tmp))
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(tmp)
        with serve(Path(tmp), engine_overrides={"max_model_len": 32, "max_num_seqs": 8},
                   max_queued_requests=4096, max_body_bytes=64 * 1024) as server:
            command = [sys.executable, "-m", "schemathesis.cli", "run", server.base_url + "/openapi.json",
                       "--checks", "not_a_server_error", "--max-examples", str(args.max_examples),
                       "--max-time", str(args.max_time), "--phases", "examples,coverage,fuzzing",
                       "--workers", "1", "--suppress-health-check", "all"]
            return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
