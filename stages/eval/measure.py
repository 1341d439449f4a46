"""`evaluate`: one model's perplexity (and KL from a reference) on one evaluation text (texts.py), with the
protocol of perplexity.py: the text tokenised once, its first `max_windows` windows of `seqlen` tokens scored."""
from __future__ import annotations

import math
import time

import torch

from ..errors import DataError
from .config import EvalConfig
from .perplexity import EvalResult, mean_kl, model_logits, tokenize_windows, window_nll
from .texts import CHAT, CODE, EvalText, eval_text

PROTOCOL = "gptq-style non-overlapping windows"


def unavailable_sets(tokenizer) -> dict[str, str]:
    """The built-in sets this model's tokenizer cannot be scored on, and why: chat needs a chat template."""
    return {} if getattr(tokenizer, "chat_template", None) else {CHAT: "the tokenizer has no chat template"}


def protocol(config: EvalConfig, text: EvalText, tokenizer) -> dict:
    """What a result was measured on: the windows, the tokenizer and the text's own facts (its file; the Python
    version and file count of `code`; the prompt count of `chat`). `special_tokens` False: none were added."""
    return {"name": PROTOCOL, "text": text.name, **text.facts, "seqlen": config.seqlen,
            "max_windows": config.max_windows, "special_tokens": False,
            "special_tokens_in_text": text.special_tokens_in_text, "tokenizer": type(tokenizer).__name__,
            "ref": config.ref}


def describe_text(p: dict) -> str:
    """A protocol's text in a few words: the file it read, or what the built-in set is."""
    if p["text"] == CODE:
        return (f"Python {p['python']} standard library ({p['stdlib']}), {p['files']:,} .py files at {p['part']}, "
                "joined by '\\n\\n'")
    if p["text"] == CHAT:
        return (f"{p['prompts']} ShareGPT prompts ({p['file']}) at {p['part']}, each a user turn through the "
                "model's chat template, its markup included")
    return f"{p['text_path']}, rows joined by '\\n\\n'"


@torch.inference_mode()
def evaluate(model, tokenizer, config: EvalConfig, ref_model=None, on_window=None) -> EvalResult:
    """Perplexity of `model` (and mean KL from `ref_model`) on the config's text (one: see EvalConfig.split)."""
    config.validate()
    text = eval_text(config.single_text(), tokenizer)
    windows, total = tokenize_windows(tokenizer, text.text, config.seqlen)
    if len(windows) == 0:
        raise DataError(f"{config.text}: only {total} tokens, fewer than one window of {config.seqlen}")
    use = windows[: config.max_windows] if config.max_windows else windows
    start, nlls, kl_sum = time.perf_counter(), [], 0.0
    for i, ids in enumerate(use):
        logits = model_logits(model, ids[None])
        nlls.append(window_nll(logits, ids[None]).item())
        if ref_model is not None:
            kl_sum += mean_kl(logits, model_logits(ref_model, ids[None])).item()
        del logits
        if on_window:
            on_window(i + 1, len(use))
    mean = sum(nlls) / len(nlls)
    return EvalResult(
        perplexity=math.exp(mean), mean_nll=mean, windows=len(use), windows_available=len(windows),
        tokens_total=total, tokens_scored=len(use) * (config.seqlen - 1), seconds=time.perf_counter() - start,
        protocol=protocol(config, text, tokenizer), window_nll=nlls,
        kl_mean=None if ref_model is None else kl_sum / (len(use) * config.seqlen),
    )
