"""Perplexity and KL divergence with the standard GPTQ-style protocol.

Rows are the text file's lines (each keeping its newline; whitespace-only lines become empty rows,
exactly the Hugging Face `wikitext-2-raw-v1` rows); text = "\\n\\n".join(rows), tokenised once with
no special tokens; non-overlapping windows of `seqlen` tokens, the tail dropped; perplexity =
exp(mean over windows of the window's mean next-token NLL).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data import resolve_text
from ..errors import DataError
from .config import EvalConfig


@dataclass
class EvalResult:
    """One model's perplexity (and KL) on one protocol, with the per-window NLLs."""

    perplexity: float
    mean_nll: float
    windows: int
    windows_available: int
    tokens_total: int
    tokens_scored: int
    seconds: float
    protocol: dict
    window_nll: list[float] = field(default_factory=list)
    kl_mean: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def record(self) -> dict:
        """What a manifest or a recipe's eval.json keeps: everything but the per-window NLLs."""
        data = self.to_dict()
        data.pop("window_nll")
        return data


def load_rows(path: Path) -> list[str]:
    """The file's lines as HF dataset rows: newline kept, whitespace-only lines empty."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None
    return [line if line.strip() else "" for line in text.splitlines(keepends=True)]


def build_text(path: Path) -> str:
    return "\n\n".join(load_rows(path))


def tokenize_windows(tokenizer, text: str, seqlen: int) -> tuple[torch.Tensor, int]:
    """Token windows [n, seqlen] (tail dropped) and the total token count."""
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    n = ids.numel() // seqlen
    return ids[: n * seqlen].view(n, seqlen), ids.numel()


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float()  # [B, S, V]


def window_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL per window: logits [B, S, V], ids [B, S] -> [B]."""
    nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")  # [B, S-1]
    return nll.mean(dim=1)


def mean_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Sum over positions of KL(P_ref || P_model) per window: [B, S, V] x2 -> [B]."""
    logp = F.log_softmax(logits, dim=-1)
    logq = F.log_softmax(ref_logits, dim=-1)
    return (logq.exp() * (logq - logp)).sum(-1).sum(-1)  # [B]


def protocol(config: EvalConfig, text_path: Path, tokenizer) -> dict:
    return {"name": "gptq-style non-overlapping windows", "text": config.text, "text_path": str(text_path),
            "seqlen": config.seqlen, "max_windows": config.max_windows, "join": "\\n\\n",
            "special_tokens": False, "tokenizer": type(tokenizer).__name__, "ref": config.ref}


@torch.inference_mode()
def evaluate(model, tokenizer, config: EvalConfig, ref_model=None, on_window=None) -> EvalResult:
    """Perplexity of `model` (and mean KL from `ref_model`) on the configured text."""
    config.validate()
    text_path = resolve_text(config.text)
    windows, total = tokenize_windows(tokenizer, build_text(text_path), config.seqlen)
    if len(windows) == 0:
        raise DataError(f"{text_path}: only {total} tokens, fewer than one window of {config.seqlen}")
    use = windows[: config.max_windows] if config.max_windows else windows
    start, nlls, kl_sum = time.perf_counter(), [], 0.0
    for i, ids in enumerate(use):
        logits = _logits(model, ids[None])
        nlls.append(window_nll(logits, ids[None]).item())
        if ref_model is not None:
            kl_sum += mean_kl(logits, _logits(ref_model, ids[None])).item()
        del logits
        if on_window:
            on_window(i + 1, len(use))
    mean = sum(nlls) / len(nlls)
    return EvalResult(
        perplexity=math.exp(mean), mean_nll=mean, windows=len(use), windows_available=len(windows),
        tokens_total=total, tokens_scored=len(use) * (config.seqlen - 1), seconds=time.perf_counter() - start,
        protocol=protocol(config, text_path, tokenizer), window_nll=nlls,
        kl_mean=None if ref_model is None else kl_sum / (len(use) * config.seqlen),
    )
