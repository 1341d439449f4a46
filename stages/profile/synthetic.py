"""`llmopt profile --synthetic SHAPE`: the serve engine on a model of a known shape with random weights,
built in memory (no files): decode tokens/s per batch size and the share of the copy bandwidth reached.

The shape is Llama-3-8B's (hidden 4096, 32 query / 8 KV heads of 128, intermediate 14336, vocab
128256, untied lm_head, llama-3 RoPE) with --layers decoder layers (default 4), or `tiny` (a CPU
check in seconds); a WordLevel tokenizer of the same vocabulary. The real runtime, `ModelRunner`
(paged KV cache; Triton kernels on CUDA) and `LLMEngine` run it: per batch size (--batch-sizes), that
many greedy requests of --decode-context random prompt tokens and --decode-steps new tokens, EOS
ignored, prompts prefilled up to PREFILL_TOKENS per step. Reported: the median wall time of the steps
in which every sequence decodes (the engine's whole step), tokens/s = batch / step, and the bytes such
a step must read at least (every weight but the embedding table, plus each sequence's cached K/V at its
median length) over the step time, as a share of the copy bandwidth measured in the same run
(machine.py, STREAM convention).

With --quantize w4a16 (or w8a16) the random layers are quantized on the device by the quantize stage's
RTN into the compressed-tensors layout (`stages/synthetic_model.py: quantize_state`, handed in by the
command, since the quantize stage itself reads this package), so the loader builds the same quantized
modules a `llmopt quantize` artifact gets; the lm_head stays dense, as `llmopt quantize` leaves it.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Iterable, Iterator

import torch

from ..errors import ConfigError
from ..families import family_of
from ..progress import StageHooks
from .config import SYNTHETIC_SHAPES as SHAPES
from .config import ProfileConfig
from .tables import TableData, human_bytes

DEFAULT_LAYERS = 4
BLOCK_SIZE = 16
PREFILL_TOKENS = 8192  # per step: a batch of 128 x 512-token prompts is prefilled in 8 steps, then decodes
WEIGHT_STD = 0.02
# (HF-named tensors, model config, scheme) -> (compressed-tensors state, quantization_config)
Quantizer = Callable[[Iterable[tuple[str, torch.Tensor]], dict, str], tuple[dict, dict]]


def model_config(shape: str, layers: int) -> dict:
    hidden, inter, heads, kv, head_dim, vocab = SHAPES[shape]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": vocab, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 8192, "tie_word_embeddings": False, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
            "bos_token_id": 0, "eos_token_id": 1}


def random_tensors(config: dict, device: torch.device, dtype: torch.dtype, std: float = WEIGHT_STD,
                   seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors drawn on the device one at a time, named and shaped as the config's family has them
    (stages/families.py): N(0, std) matrices, unit norms (a Gemma norm stores its scale minus one)."""
    h, i, v, hd = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["head_dim"]
    family = family_of(config)
    linears = family.linear_shapes(h, config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd, i)
    unit = 1.0 - family.norm_offset
    g = torch.Generator(device=device).manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g, device=device, dtype=torch.float32) * std).to(dtype)

    yield "model.embed_tokens.weight", mat(v, h)
    yield "lm_head.weight", mat(v, h)
    yield "model.norm.weight", torch.full((h,), unit, device=device, dtype=dtype)
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        for name, (rows, cols) in linears.items():
            yield p + name + ".weight", mat(rows, cols)
        for name, size in family.norm_sizes(h, hd).items():
            yield p + name + ".weight", torch.full((size,), unit, device=device, dtype=dtype)


def random_state(config: dict, device: torch.device, dtype: torch.dtype, std: float = WEIGHT_STD,
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """`random_tensors` as a state dict."""
    return dict(random_tensors(config, device, dtype, std, seed))


def word_tokenizer(vocab: int):
    """Words w0..w{vocab-1}, one token each; w1 is EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1", unk_token="w0")


def make_engine(config: dict, state: dict, device: torch.device, dtype: torch.dtype, backend: str, max_seqs: int,
                max_len: int, enforce_eager: bool = False):
    """(engine, runtime): the serve runtime on `state` (HF names), its runner with room for `max_seqs`
    sequences of `max_len` tokens, and an LLMEngine with a word tokenizer (no EOS: requests run to length).
    Decode steps are captured in CUDA graphs where `llmopt serve` would capture them, unless `enforce_eager`."""
    from ..serve.cuda_graphs import graph_batch_sizes, graphs_apply
    from ..serve.engine.config import EngineConfig
    from ..serve.engine.engine import LLMEngine
    from ..serve.loader import build_runtime
    from ..serve.runner import ModelRunner

    runtime = build_runtime(config, state, device, dtype, backend)
    blocks = max_seqs * -(-max_len // BLOCK_SIZE) + 16
    runner = ModelRunner(runtime, blocks, BLOCK_SIZE)
    if not enforce_eager and graphs_apply(runtime):
        runner.try_capture_decode_graphs(graph_batch_sizes(max_seqs))
    engine = LLMEngine(runner, word_tokenizer(config["vocab_size"]),
                       EngineConfig(block_size=BLOCK_SIZE, num_blocks=blocks, max_num_seqs=max_seqs,
                                    max_num_batched_tokens=max(PREFILL_TOKENS, max_len), enable_prefix_caching=False),
                       eos_token_ids=[])
    return engine, runtime


def synthetic_state(model: dict, config: ProfileConfig, device: torch.device, dtype: torch.dtype,
                    quantizer: Quantizer | None) -> tuple[dict, dict]:
    """(state, model config): random weights on the device, quantized by `quantizer` if --quantize asks."""
    tensors = random_tensors(model, device, dtype)
    if config.quantize is None:
        return dict(tensors), model
    if quantizer is None:
        raise ConfigError(f"--quantize {config.quantize}: no quantizer was given to the synthetic run")
    state, qconfig = quantizer(tensors, model, config.quantize)
    return state, {**model, "quantization_config": qconfig}


def run_batch(engine, batch: int, prompt_len: int, tokens: int, vocab: int, seed: int) -> tuple[float, float, int]:
    """(median decode-step seconds, median context length during those steps, steps timed)."""
    from ..serve.engine.config import SamplingParams

    g = torch.Generator().manual_seed(seed)
    for r in range(batch):
        ids = torch.randint(2, vocab, (prompt_len,), generator=g).tolist()
        engine.add_request(f"b{batch}-{r}", prompt_token_ids=ids,
                           params=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    steps, contexts = [], []
    while engine.has_unfinished():
        start = time.perf_counter()
        outs = engine.step()
        seconds = time.perf_counter() - start
        if len(outs) == batch and all(o.num_output_tokens >= 2 and len(o.token_ids) == 1 for o in outs):
            steps.append(seconds)  # every sequence decoded one token (no prefill in this step)
            contexts.append(prompt_len + outs[0].num_output_tokens)
    if not steps:
        raise ConfigError(f"batch {batch}: no step in which every sequence decodes (raise --decode-steps)")
    return statistics.median(steps), statistics.median(contexts), len(steps)


def run_synthetic(config: ProfileConfig, hooks: StageHooks | None = None, quantizer: Quantizer | None = None) -> dict:
    """The engine on the synthetic model, one row per batch size (see the module docstring)."""
    from ..model_io import parse_dtype
    from .machine import copy_bandwidth, describe

    hooks = hooks or StageHooks()
    device, dtype = torch.device(config.device), parse_dtype(config.dtype) or torch.bfloat16
    layers = config.layers or DEFAULT_LAYERS
    start = time.perf_counter()
    state, model = synthetic_state(model_config(config.synthetic, layers), config, device, dtype, quantizer)
    weights = sum(t.numel() * t.element_size() for n, t in state.items() if not n.startswith("model.embed_tokens"))
    engine, _ = make_engine(model, state, device, dtype, config.backend, max(config.batch_sizes),
                            config.decode_context + config.decode_steps, config.enforce_eager)
    del state
    built = time.perf_counter() - start
    copy = copy_bandwidth(device, config.copy_mib)
    kv_per_token = layers * 2 * model["num_key_value_heads"] * model["head_dim"] * dtype.itemsize
    hooks.status(f"{config.synthetic} x {layers} layers{weights_label(config)} on {device}: built in {built:.1f} s; "
                 f"{weights / 1e9:.2f} GB of weights read per step")
    run_batch(engine, 1, 32, 4, model["vocab_size"], seed=99)  # warm-up: kernels compiled, caches touched
    rows = []
    for batch in config.batch_sizes:
        step, ctx, n = run_batch(engine, batch, config.decode_context, config.decode_steps, model["vocab_size"], batch)
        nbytes = weights + batch * ctx * kv_per_token
        rows.append({"batch": batch, "step_ms": step * 1e3, "steps": n, "tokens_per_s": batch / step,
                     "bytes_per_step": nbytes, "gb_per_s": nbytes / step / 1e9,
                     "share": nbytes / step / copy["bytes_per_s"]})
        hooks.status(f"batch {batch}: {step * 1e3:.2f} ms per decode step")
    return {"tool": "llmopt profile --synthetic", "shape": config.synthetic, "layers": layers, "dtype": str(dtype),
            "quantize": config.quantize, "machine": {**describe(device), "copy": copy}, "build_seconds": built,
            "cuda_graphs": engine.runner.graphs.sizes if engine.runner.graphs is not None else None,
            "weight_bytes": weights, "rows": rows, "config": config.to_dict()}


def weights_label(config_or_report) -> str:
    """', W4A16 RTN' when the layers were quantized, else ''."""
    source = config_or_report
    scheme = source.quantize if isinstance(source, ProfileConfig) else source.get("quantize")
    return f", {scheme.upper()} RTN" if scheme else ""


def synthetic_tables(report: dict) -> list[TableData]:
    copy = report["machine"]["copy"]["bytes_per_s"] / 1e9
    t = TableData("synthetic", f"engine decode on synthetic {report['shape']} x {report['layers']} layers, "
                               f"{report['dtype'].removeprefix('torch.')}{weights_label(report)}, "
                               f"{report['machine']['device']}",
                  ["batch", "decode step ms (steps)", "tokens/s", "bytes per step", "GB/s", "share of copy bandwidth"])
    t.rows = [[str(r["batch"]), f"{r['step_ms']:.2f} ({r['steps']})", f"{r['tokens_per_s']:.1f}",
               human_bytes(r["bytes_per_step"]), f"{r['gb_per_s']:.0f}", f"{r['share']:.0%}"]
              for r in report["rows"]]
    graphs = report.get("cuda_graphs")
    t.note = (f"copy bandwidth {copy:.0f} GB/s (read + written, best of {report['machine']['copy']['repeats']}); "
              + (f"decode in CUDA graphs (batch buckets {', '.join(map(str, graphs))})" if graphs else "eager decode"))
    return [t]
