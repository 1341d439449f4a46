"""`python -m llmopt.stages.serve.baseline SOURCE --port P`: the plain-transformers server that
`llmopt bench --server SOURCE --engine hf` starts (one request at a time, no batching, no paged cache)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m llmopt.stages.serve.baseline", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="HF directory, llmopt artifact, alias or .gguf")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--served-model-name", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    import uvicorn
    from transformers import AutoTokenizer

    from .app import build_app
    from .hf import load_model, model_dir
    from .worker import Baseline

    if args.threads:
        torch.set_num_threads(args.threads)
    directory = model_dir(args.source)
    model = load_model(directory, args.dtype, args.device)
    server = Baseline(model, AutoTokenizer.from_pretrained(directory), args.served_model_name or Path(args.source).name)
    uvicorn.run(build_app(server), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2)


if __name__ == "__main__":
    main()
