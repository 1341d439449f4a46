#!/usr/bin/env python3
"""Independent perplexity reference: plain transformers, no llmopt code.

Follows the usual GPTQ-style recipe as people write it by hand: rows of the HF wikitext-2-raw-v1
split ("\\n\\n".join), one tokenisation, non-overlapping windows, `model(ids, labels=ids).loss` per
window, ppl = exp(mean loss). Used by tests and by hand to cross-check `llmopt eval`.

    python scripts/ppl_reference.py MODEL_DIR_OR_GGUF TEXT_FILE [--seqlen 2048] [--max-windows N]
"""
import argparse
import json
import math
import os
import sys
import time


def hf_rows(path):
    # The HF dataset stores each line of the raw file as a row; blank lines (a single space) as "".
    with open(path, encoding="utf-8") as f:
        return ["" if line.strip() == "" else line for line in f.read().splitlines(True)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="HF model directory or .gguf file")
    parser.add_argument("text")
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--max-windows", type=int, default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    folder = args.model
    if args.model.endswith(".gguf"):
        folder, kwargs["gguf_file"] = os.path.split(os.path.abspath(args.model))
    tok = AutoTokenizer.from_pretrained(folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    enc = tok("\n\n".join(hf_rows(args.text)), return_tensors="pt", add_special_tokens=False).input_ids
    n = enc.shape[1] // args.seqlen
    use = min(n, args.max_windows or n)
    start, losses = time.time(), []
    with torch.no_grad():
        for i in range(use):
            ids = enc[:, i * args.seqlen:(i + 1) * args.seqlen]
            losses.append(model(ids, labels=ids).loss.item())
    ppl = math.exp(sum(losses) / len(losses))
    json.dump({"perplexity": ppl, "windows": use, "windows_available": n, "tokens_total": enc.shape[1],
               "window_nll": losses, "seconds": time.time() - start}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
