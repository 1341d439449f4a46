"""The math of perplexity and KL divergence under the standard GPTQ-style protocol (measure.py drives it).

A text file's rows are its lines (each keeping its newline; whitespace-only lines become empty rows,
exactly the Hugging Face `wikitext-2-raw-v1` rows), and its text is "\\n\\n".join(rows) (texts.py holds the
other evaluation texts). The text is tokenised once with no special tokens added; non-overlapping windows of
`seqlen` tokens, the tail dropped; perplexity = exp(mean over windows of the window's mean next-token NLL).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import DataError


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


def model_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits in fp32: ids [B, S] -> [B, S, V]."""
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
