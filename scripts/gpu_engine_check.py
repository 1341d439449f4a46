"""The serve engine on a synthetic Llama-3-8B-shaped model: decode tokens/s and share of memory bandwidth.

Part of `scripts/gpu_check.sh` (one H200, well under 5 minutes). The model is built here, no files:
Llama-3-8B's shapes (hidden 4096, 32 query / 8 KV heads of 128, intermediate 14336, vocab 128256,
untied lm_head, llama-3 RoPE) with --layers decoder layers (default 4) of random weights, and a
WordLevel tokenizer of the same vocabulary. The real `build_runtime`, `ModelRunner` (paged KV cache;
Triton kernels on CUDA) and `LLMEngine` (scheduler, sampler, detokenizer) run it: for each batch size,
that many greedy requests of --prompt-len random prompt tokens and --tokens new tokens (EOS ignored).

Reported per batch size: the median wall time of the steps in which every sequence decodes (the
engine's whole step: schedule, inputs, forward, sampling, detokenization), tokens/s = batch / step,
and the bytes such a step must read at least (every weight except the embedding table, plus each
sequence's cached K/V at its median length) over the step time, as a share of the copy bandwidth
measured in the same run ((read + write) / time of a 1 GiB clone).

    python scripts/gpu_engine_check.py                     # CUDA, bf16, batches 1 and 32
    python scripts/gpu_engine_check.py --device cpu --shape tiny   # the same path on CPU, seconds
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {  # hidden, intermediate, heads, kv heads, head dim, vocab
    "llama3-8b": (4096, 14336, 32, 8, 128, 128256),
    "tiny": (256, 512, 8, 2, 32, 4096),
}


def model_config(shape: str, layers: int) -> dict:
    hidden, inter, heads, kv, head_dim, vocab = SHAPES[shape]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": vocab, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 8192, "tie_word_embeddings": False, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
            "bos_token_id": 0, "eos_token_id": 1}


def random_state(config: dict, device, dtype) -> dict[str, torch.Tensor]:
    """HF-named tensors, drawn on the device (N(0, 0.02) matrices, unit norms)."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    g = torch.Generator(device=device).manual_seed(0)

    def mat(rows, cols):
        return (torch.randn(rows, cols, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

    state = {"model.embed_tokens.weight": mat(v, h), "lm_head.weight": mat(v, h),
             "model.norm.weight": torch.ones(h, device=device, dtype=dtype)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        for name, rows, cols in (("self_attn.q_proj", q, h), ("self_attn.k_proj", kv, h), ("self_attn.v_proj", kv, h),
                                 ("self_attn.o_proj", h, q), ("mlp.gate_proj", i, h), ("mlp.up_proj", i, h),
                                 ("mlp.down_proj", h, i)):
            state[p + name + ".weight"] = mat(rows, cols)
        for name in ("input_layernorm", "post_attention_layernorm"):
            state[p + name + ".weight"] = torch.ones(h, device=device, dtype=dtype)
    return state


def word_tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1", unk_token="w0")


def copy_bandwidth(device) -> float:
    """GB/s of (read + write) for a 1 GiB clone (256 MiB on CPU), median of 5."""
    buf = torch.empty((1 << 30) if device.type == "cuda" else (1 << 28), dtype=torch.uint8, device=device)
    times = []
    for _ in range(6):
        sync(device)
        t = time.perf_counter()
        buf.clone()
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * buf.numel() / statistics.median(times[1:]) / 1e9


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_batch(engine, batch: int, prompt_len: int, tokens: int, vocab: int, seed: int):
    """(median decode-step seconds, median context length during those steps, steps timed)."""
    from llmopt.stages.serve.engine.config import SamplingParams

    g = torch.Generator().manual_seed(seed)
    for r in range(batch):
        ids = torch.randint(2, vocab, (prompt_len,), generator=g).tolist()
        engine.add_request(f"b{batch}-{r}", prompt_token_ids=ids,
                           params=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    steps, contexts = [], []
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if len(outs) == batch and all(o.num_output_tokens >= 2 and len(o.token_ids) == 1 for o in outs):
            steps.append(dt)  # every sequence decoded one token (no prefill in this step)
            contexts.append(prompt_len + outs[0].num_output_tokens)
    if not steps:
        raise SystemExit(f"batch {batch}: no pure decode step was seen (raise --tokens)")
    return statistics.median(steps), statistics.median(contexts), len(steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from llmopt.stages.serve.engine.config import EngineConfig
    from llmopt.stages.serve.engine.engine import LLMEngine
    from llmopt.stages.serve.loader import build_runtime
    from llmopt.stages.serve.runner import ModelRunner

    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    config = model_config(args.shape, args.layers)
    t0 = time.perf_counter()
    runtime = build_runtime(config, random_state(config, device, dtype), device, dtype)
    block_size, longest = 16, max(args.batches)
    blocks = longest * -(-(args.prompt_len + args.tokens) // block_size) + 16
    runner = ModelRunner(runtime, blocks, block_size)
    engine = LLMEngine(runner, word_tokenizer(config["vocab_size"]),
                       EngineConfig(block_size=block_size, num_blocks=blocks, max_num_seqs=longest,
                                    max_num_batched_tokens=max(2048, args.prompt_len), enable_prefix_caching=False),
                       eos_token_ids=[])
    built = time.perf_counter() - t0
    bandwidth = copy_bandwidth(device)
    elem = torch.empty(0, dtype=dtype).element_size()
    weights = sum(t.numel() * t.element_size() for n, t in runtime.state_dict().items() if n != "embed_tokens")
    kv_per_token = args.layers * 2 * config["num_key_value_heads"] * config["head_dim"] * elem
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{args.shape} x {args.layers} layers, {args.dtype} on {name}: built in {built:.1f} s; weights read per "
          f"step {weights / 1e9:.2f} GB; copy bandwidth {bandwidth:.0f} GB/s")
    run_batch(engine, 1, 32, 4, config["vocab_size"], seed=99)  # warm-up: kernels compiled, caches touched
    print("| batch | decode step ms (median of N) | tokens/s | bytes per step | GB/s | share of copy bandwidth |")
    print("|---|---|---|---|---|---|")
    rows = []
    for batch in args.batches:
        step, ctx, n = run_batch(engine, batch, args.prompt_len, args.tokens, config["vocab_size"], seed=batch)
        nbytes = weights + batch * ctx * kv_per_token
        rate = nbytes / step / 1e9
        rows.append({"batch": batch, "step_ms": round(step * 1e3, 3), "steps": n, "tokens_per_s": round(batch / step, 1),
                     "bytes_per_step": nbytes, "gb_per_s": round(rate, 1), "share": round(rate / bandwidth, 3)})
        print(f"| {batch} | {step * 1e3:.2f} ({n}) | {batch / step:.1f} | {nbytes / 1e9:.2f} GB | {rate:.0f} | "
              f"{100 * rate / bandwidth:.0f}% |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "layers": args.layers, "dtype": args.dtype,
                                         "device": name, "copy_gb_per_s": round(bandwidth, 1), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
