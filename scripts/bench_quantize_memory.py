#!/usr/bin/env python3
"""Peak memory of a layer-by-layer GPTQ run on a 24-layer random Llama, against one layer plus the
calibration activations (the quantize issue's memory bound).

The model is loaded memory-mapped (file-backed pages, which the kernel can drop), so the number that
matters is anonymous memory (RssAnon): what the stage itself allocates. Sampled every 2 ms.
"Activations" are every window's stored layer inputs and outputs plus the working set of one float
layer forward over one batch (attention scores, MLP intermediates), measured here the same way.
Run it with --layers 6 and --layers 24: a bound that holds for both does not grow with the model.

    .venv/bin/python scripts/bench_quantize_memory.py [--layers 24] [--hidden 512] [--nsamples 32] [--seqlen 512]
"""
import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss_anon() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.running = rss_anon(), True

    def run(self):
        while self.running:
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.002)


def build(path: Path, layers: int, hidden: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers import make_tokenizer

    tok = make_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    layer = model.model.layers[0]
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def forward_working_set(model_dir: Path, nsamples: int, seqlen: int, batch_size: int) -> int:
    """Peak anonymous memory of one float decoder-layer forward over one calibration batch: the
    activations any layer-by-layer method needs just to run the layer."""
    import torch

    from llmopt.stages.layerwise import capture_inputs, decoder_layers, forward_layer
    from llmopt.stages.model_io import load_model_dir

    model = load_model_dir(model_dir)
    ids = torch.randint(0, model.config.vocab_size, (min(batch_size, nsamples), seqlen))
    batches = capture_inputs(model, ids, batch_size)
    sampler = PeakSampler()
    base = rss_anon()
    sampler.start()
    forward_layer(decoder_layers(model)[0], batches, "cpu", keep=True)
    sampler.running = False
    sampler.join()
    return sampler.peak - base


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--nsamples", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    from llmopt.stages.calib import CalibConfig
    from llmopt.stages.quantize.config import QuantizeConfig
    from llmopt.stages.quantize.run import run_quantize

    work = Path(tempfile.mkdtemp(prefix="llmopt-mem-"))
    layer_bytes = build(work / "model", args.layers, args.hidden)
    stored = 2 * args.nsamples * args.seqlen * args.hidden * 4  # every window's layer inputs + outputs, fp32
    working = forward_working_set(work / "model", args.nsamples, args.seqlen, args.batch_size)
    activation_bytes = stored + working
    config = QuantizeConfig(method="gptq", group_size=64, eval_windows=0, batch_size=args.batch_size,
                            calib=CalibConfig("wikitext2-valid", args.nsamples, args.seqlen))
    sampler = PeakSampler()
    base = rss_anon()
    sampler.start()
    start = time.perf_counter()
    run_quantize(str(work / "model"), work / "gptq", config)
    seconds = time.perf_counter() - start
    sampler.running = False
    sampler.join()
    peak = sampler.peak - base
    bound = layer_bytes + activation_bytes
    result = {"layers": args.layers, "layer_bytes": layer_bytes, "model_layers_bytes": layer_bytes * args.layers,
              "stored_hidden_bytes": stored, "layer_forward_working_set_bytes": working, "peak_anon_bytes_above_start": peak,
              "peak_over_layer_plus_activations": peak / bound, "seconds": round(seconds, 1)}
    mib = 2 ** 20
    print(f"one layer {layer_bytes / mib:.1f} MiB, {args.layers} layers {layer_bytes * args.layers / mib:.1f} MiB; "
          f"activations {activation_bytes / mib:.1f} MiB = stored layer inputs/outputs {stored / mib:.1f} "
          f"+ one layer forward's working set {working / mib:.1f}")
    print(f"peak anonymous memory during quantize: {peak / mib:.1f} MiB = "
          f"{peak / bound:.2f} x (one layer + activations)   [{seconds:.0f} s]")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
