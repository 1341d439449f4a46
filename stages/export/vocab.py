"""The tokenizer as llama.cpp reads it from GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).

A byte-level BPE (GPT-2 style: SmolLM2, Llama 3, Qwen) is `tokenizer.ggml.model = gpt2`: every token as
tokenizer.json spells it, its type (NORMAL; CONTROL for a special added token, USER_DEFINED for another added
one; UNUSED for the `[PADi]` rows an embedding has beyond the vocabulary), the merges, the special ids, whether
BOS and EOS are added, and the chat template. gguf's `SpecialVocab` reads the merges, ids and template from the
artifact's tokenizer files; the tokens, their types and the BOS/EOS behaviour (what the tokenizer does to a
text, not what a flag says) are ours.

llama.cpp splits text before BPE with a regex it picks by name (`tokenizer.ggml.pre`). The name comes from
--tokenizer-pre, else from the GGUF the artifact was imported from (it still holds the model's own), else from
tokenizer.json's pre-tokenizer where its shape tells (`PRE_TOKENIZERS`; a Split regex that transformers' GGUF loader
knows by name), else `default`, which the result notes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .gguf_meta import source_strings

# tokenizer.json pre-tokenizer shapes whose llama.cpp name is certain: GPT-2's regex, SmolLM2's digits first
PRE_TOKENIZERS = {
    (("ByteLevel", True),): "gpt2",
    (("Digits", True), ("ByteLevel", True)): "smollm",
}
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5  # gguf.TokenType


@dataclass
class Vocab:
    """What is written: the tokens and their types, the pre-tokenizer and where its name came from, the rest
    (merges, special ids, template) in gguf's SpecialVocab."""

    tokens: list[str]
    types: list[int]
    pre: str
    pre_from: str  # "--tokenizer-pre" | "the source GGUF" | "tokenizer.json" | "a guess"
    add_bos: bool
    add_eos: bool
    special: object  # gguf.SpecialVocab

    def record(self) -> dict:
        return {"model": "gpt2", "pre": self.pre, "pre_from": self.pre_from, "tokens": len(self.tokens),
                "merges": len(self.special.merges), "add_bos": self.add_bos, "add_eos": self.add_eos,
                "special_ids": dict(self.special.special_token_ids),
                "chat_template": self.special.chat_template is not None}


def read_vocab(directory: Path, rows: int, pre: str | None, source: dict) -> Vocab:
    """The vocabulary of the tokenizer in `directory`, padded to the embedding's `rows`."""
    import gguf
    from tokenizers import Tokenizer

    spec = _tokenizer_json(directory)
    model, decoder = spec.get("model") or {}, spec.get("decoder") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder.get("type") != "ByteLevel":
        raise ConfigError(f"export: {directory}/tokenizer.json is not a byte-level BPE (model {model.get('type')}, "
                          f"decoder {decoder.get('type')}); GGUF export writes GPT-2-style tokenizers only")
    tok = Tokenizer.from_str(json.dumps(spec))
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    if by_id and max(by_id) >= rows:
        raise ConfigError(f"export: the tokenizer has ids up to {max(by_id)}, the embedding only {rows} rows")
    added = tok.get_added_tokens_decoder()
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(rows)]
    types = [UNUSED if i not in by_id else NORMAL if i not in added else CONTROL if added[i].special
             else USER_DEFINED for i in range(rows)]
    special = gguf.SpecialVocab(directory, load_merges=True, n_vocab=rows)
    ids = tok.encode("a").ids  # with the post-processor: BOS / EOS where the tokenizer adds them
    bos, eos = special.special_token_ids.get("bos"), special.special_token_ids.get("eos")
    add_bos, add_eos = bool(ids) and ids[0] == bos, bool(ids) and ids[-1] == eos
    special.add_special_token = {"bos": add_bos, "eos": add_eos}
    name, where = pre_tokenizer(spec, pre, source)
    return Vocab(tokens, types, name, where, add_bos, add_eos, special)


def _tokenizer_json(directory: Path) -> dict:
    try:
        return json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"export: {directory}/tokenizer.json cannot be read ({e}); GGUF export needs the "
                          "tokenizer.json that transformers writes") from None


def pre_tokenizer(spec: dict, given: str | None, source: dict) -> tuple[str, str]:
    """(llama.cpp's pre-tokenizer name, where it came from)."""
    if given:
        return given, "--tokenizer-pre"
    from_gguf = _source_gguf_pre(source)
    if from_gguf:
        return from_gguf, "the source GGUF"
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    shape = tuple((s.get("type"), bool(s.get("use_regex") if s.get("type") == "ByteLevel"
                                       else s.get("individual_digits"))) for s in steps)
    name = PRE_TOKENIZERS.get(shape) or _split_name(steps)
    return (name, "tokenizer.json") if name else ("default", "a guess")


def _split_name(steps: list[dict]) -> str | None:
    """The name of a Split-regex-then-ByteLevel pre-tokenizer (Llama 3, Qwen2), from the table transformers' GGUF
    loader keeps the other way round (name -> regex; the first name of a regex is one llama.cpp accepts)."""
    if len(steps) != 2 or steps[0].get("type") != "Split" or steps[1].get("type") != "ByteLevel":
        return None
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:  # another transformers layout: no name, a guess
        return None
    regex = (steps[0].get("pattern") or {}).get("Regex")
    return next((name for name, split in GGUF_PRE_TOKENIZER_SPLITS.items() if split == regex), None)


def _source_gguf_pre(source: dict) -> str | None:
    """The source GGUF's `tokenizer.ggml.pre`, when it holds a byte-level BPE (`gguf_meta.source_strings`)."""
    keys = source_strings(source, ("tokenizer.ggml.model", "tokenizer.ggml.pre"))
    return keys.get("tokenizer.ggml.pre") if keys.get("tokenizer.ggml.model") == "gpt2" else None


def write_vocab(writer, vocab: Vocab) -> dict:
    """The tokenizer keys into `writer`; returns the record of what was written (`Vocab.record`)."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    vocab.special.add_to_gguf(writer, quiet=True)
    return vocab.record()
