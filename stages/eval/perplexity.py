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


NLL_CHUNK_BYTES = 16 << 20  # the log-softmax temporary of one chunk of rows


def window_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL per window: logits [B, S, V], ids [B, S] -> [B].

    Over the rows of [B * S, V] as they lie (the last position's target ignored), a 16 MiB chunk of rows at a
    time. Not over a sliced, transposed [B, V, S-1] view (torch then copies it and walks the vocabulary
    strided: 6x slower for SmolLM2's 49,152, 30x for Gemma 3's 262,144), nor in one call (its [B * S, V]
    temporary, 2 GiB for one Gemma 3 window, is fresh memory every time: 13-18 s of page faults here against
    0.8-1.3 s in chunks that the allocator reuses)."""
    b, s, v = logits.shape
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    rows, targets = logits.reshape(b * s, v), targets.reshape(-1)
    step = max(1, NLL_CHUNK_BYTES // (v * logits.element_size()))
    nll = torch.cat([F.cross_entropy(rows[i:i + step], targets[i:i + step], reduction="none")
                     for i in range(0, b * s, step)]).view(b, s)
    return nll[:, :-1].mean(dim=1)


def mean_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Sum over positions of KL(P_ref || P_model) per window: [B, S, V] x2 -> [B]."""
    logp = F.log_softmax(logits, dim=-1)
    logq = F.log_softmax(ref_logits, dim=-1)
    return (logq.exp() * (logq - logp)).sum(-1).sum(-1)  # [B]
