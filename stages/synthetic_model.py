"""Synthetic Llama-shaped models: random weights of a known shape (`profile/synthetic.py`), quantized in
memory by the quantize stage's RTN, or written to disk as an artifact with a real tokenizer.

- `quantize_state`: every decoder Linear of a random state dict as `llmopt quantize --method rtn` would
  write it (the same grid, observer and automatic group size from `quantize/rtn.py`, the compressed-tensors
  layout and `quantization_config` from `compressed.py`); the lm_head stays dense, as `llmopt quantize`
  leaves it. `llmopt profile --synthetic SHAPE --quantize w4a16` runs the engine on the result.
- `chat_tokenizer`: a byte-level BPE trained in code on a fixed text (any string encodes), with ChatML
  markers and a chat template, as a model hub's small chat models ship.
- `write_synthetic_model`: the model with that tokenizer's vocabulary as an `llmopt` artifact (stage
  `synthetic`): config.json, generation_config.json, tokenizer files, safetensors, manifest. Every other
  command takes it as a source (`llmopt quantize`, `serve`, `bench --server`).

This module sits beside the stages, not inside `profile/`: it reads the quantize stage, which reads
`profile/machine.py`, and a package may not import one that imports it back.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable

import torch

from .artifact import Artifact, ArtifactWriter, safetensors_bytes
from .compressed import LinearScheme, build_quantization_config, compress_linear
from .errors import ConfigError
from .model_io import DTYPE_NAMES, parse_dtype
from .profile.synthetic import model_config, random_tensors
from .quantize.rtn import QuantArgs, compute_qparams, quantize, resolve_group_size
from .safetensors_io import save_state_dict

SAVED_LAYERS = 2  # --save-model's decoder layers unless --layers says otherwise
SCHEMES = {"w4a16": 4, "w8a16": 8}  # weight bits; symmetric, activations left in the model's dtype
DECODER_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj$")
TOKENIZER_VOCAB = 512
START, END = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}" + START + "{{ message['role'] }}\n{{ message['content'] }}" + END + "\n"
    "{% endfor %}{% if add_generation_prompt %}" + START + "assistant\n{% endif %}"
)
CORPUS = """\
A language model reads a prompt one token at a time and predicts the next token from the ones before it.
Serving it well means keeping the accelerator busy: many requests share one batch, their keys and values
live in a paged cache of fixed-size blocks, and a scheduler decides at every step which sequences run.
Compression makes the weights smaller: four-bit integers with a scale per group of 128 columns read a
quarter of the bytes of sixteen-bit floats, and decoding a single sequence is bound by those reads.
The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. 0123456789
Questions and answers, lists and tables, code like `for i in range(10): print(i)` and numbers like 3.14.
"""


def quantize_state(tensors: Iterable[tuple[str, torch.Tensor]], config: dict, scheme: str) -> tuple[dict, dict]:
    """(state, quantization_config): each decoder Linear's weight RTN-quantized (symmetric, min/max
    range, group 128, 64 or 32 by what divides its input size) where it lies, consumed one tensor at a
    time so only one dense matrix is ever added to the compressed ones."""
    if scheme not in SCHEMES:
        raise ConfigError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    state, schemes = {}, {}
    for key, tensor in tensors:
        name = key.removesuffix(".weight")
        if not (key.endswith(".weight") and DECODER_LINEAR.match(name)):
            state[key] = tensor
            continue
        args = QuantArgs(SCHEMES[scheme], resolve_group_size(tensor.shape[1], None, name), scale_dtype=tensor.dtype)
        w = tensor.float()
        scale, zero = compute_qparams(w, args)
        layout = LinearScheme(args.bits, args.group_size, args.symmetric, activations=False)
        state.update(compress_linear(name, quantize(w, scale, zero, args), scale, zero, layout, tensor.dtype))
        schemes[name] = layout
        del w, tensor
    linears = sorted(schemes) + (["lm_head"] if "lm_head.weight" in state else [])
    return state, build_quantization_config(schemes, linears)


def chat_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    """A byte-level BPE of `vocab_size` entries (or as many merges as the text gives) trained on CORPUS,
    with the ChatML markers as special tokens (END is EOS) and a chat template; deterministic, a few ms."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END, START], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END, bos_token=START, pad_token=END)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_synthetic_model(dest: Path, shape: str, layers: int = SAVED_LAYERS, dtype: torch.dtype | None = None,
                          device: str = "cpu", force: bool = False, seed: int = 0) -> Artifact:
    """The synthetic `shape` with `layers` random decoder layers and `chat_tokenizer`'s vocabulary, drawn on
    `device` and written in `dtype` (default bf16) as an artifact at `dest` (atomically; `force` replaces an
    artifact)."""
    dtype = dtype or torch.bfloat16
    tokenizer = chat_tokenizer()
    config = model_config(shape, layers) | {
        "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id, "dtype": str(dtype).removeprefix("torch.")}
    state = dict(random_tensors(config, torch.device(device), dtype, seed=seed))
    record = {"shape": shape, "layers": layers, "dtype": DTYPE_NAMES[dtype], "seed": seed, "vocab_size": len(tokenizer)}
    with ArtifactWriter(dest, force=force) as w:
        (w.tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                      "pad_token_id": config["pad_token_id"]}
        (w.tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        tokenizer.save_pretrained(w.tmp)
        save_state_dict(state, w.tmp)
        model = {"architecture": "LlamaForCausalLM", "model_type": "llama", "dtype": record["dtype"],
                 "num_parameters": sum(t.numel() for t in state.values()), "num_hidden_layers": layers,
                 "hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"]}
        return w.commit("synthetic", record, None, {"kind": "synthetic", "ref": f"synthetic:{shape}"}, model=model,
                        metrics={"size_bytes": safetensors_bytes(w.tmp), "num_parameters": model["num_parameters"]})



def save_model(config) -> dict:
    """`llmopt profile --synthetic SHAPE --save-model DIR` (a ProfileConfig): the artifact's path and facts."""
    art = write_synthetic_model(Path(config.save_model), config.synthetic, config.layers or SAVED_LAYERS,
                                parse_dtype(config.dtype), config.device)
    return {"tool": "llmopt profile --synthetic --save-model", "path": str(art.path),
            "content_hash": art.content_hash, "model": art.manifest["model"]}
