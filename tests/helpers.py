"""Tiny random-weight models and tokenizers built inside the tests (no files, no network)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a language model predicts the next token from the previous ones",
    "pack the weights, verify the hashes, and write atomically",
    "twelve small layers of attention and a gated feed forward block",
] * 4


def make_tokenizer(vocab_size: int = 300):
    """A byte-level BPE trained on a fixed corpus: deterministic, a few ms."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_chat_tokenizer():
    """`make_tokenizer` with ChatML's markers as added special tokens and a ChatML template: deterministic too."""
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def few_stdlib_files(monkeypatch, count: int = 12) -> None:
    """The code evaluation set read from the standard library's first `count` files (in its sorted order) only:
    for tests about what is done with each set's result, which need not tokenize the whole library's 6 MB."""
    from llmopt.stages.eval import texts

    files = texts.stdlib_files()[:count]
    monkeypatch.setattr(texts, "stdlib_files", lambda: files)


def make_model(vocab_size: int, seed: int = 0, tie: bool = True, layers: int = 2, hidden: int = 32, heads: int = 4,
               kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                         tie_word_embeddings=tie, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF init is tiny (std 0.02); widen it so logits are not all equal
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


def write_hf_dir(path: Path, seed: int = 0, tie: bool = True, layers: int = 2, hidden: int = 32, heads: int = 4,
                 kv_heads: int = 2):
    """A plain HF model directory (config, tokenizer, safetensors), as `save_pretrained` writes it."""
    tok = make_tokenizer()
    model = make_model(len(tok), seed=seed, tie=tie, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def write_chat_model_dir(path: Path, chat_template: str):
    """`write_hf_dir` with a chat template on the tokenizer (for chat endpoints and --chat prompts)."""
    _, tok = write_hf_dir(path)
    tok.chat_template = chat_template
    tok.save_pretrained(path)
    return path


# oneDNN packs bf16 weights only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; elsewhere a bf16 DenseLinear
# serves through F.linear, and the tests of its oneDNN routes do not apply.
needs_onednn_bf16 = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                       reason="oneDNN packs bf16 weights only with AVX-512 or AVX-NE-CONVERT")
BF16_ROUTED = pytest.param(torch.bfloat16, marks=needs_onednn_bf16, id="bf16")
# fbgemm's AVX2 kernels sum pairs of int8 products in saturating int16 (AVX-512 VNNI does not): W8A8's error
# bounds, measured on AVX-512 machines, do not hold on AVX2-only CPUs.
needs_avx512_fbgemm = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                                         reason="W8A8 through fbgemm: its AVX2 kernels saturate int16 pair sums")
# Bit-exact padding (a batch of 3 run as 4 rows) needs GEMMs whose rows do not depend on the row count, which
# MKL's AVX-512 kernels are here and its AVX2 ones are not.
needs_row_independent_gemm = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                                                reason="MKL's AVX2 GEMMs round a row differently by the row count")
