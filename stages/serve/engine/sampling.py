"""Batched sampling: one next token per row of logits [R, vocab], each row with its own params.

Order per row: penalties (repetition on prompt + output, presence/frequency on the output), then
greedy argmax, or temperature -> top-k -> top-p -> min-p -> a draw. Draws use the exponential race
(argmax of p / E with E ~ Exp(1)), so a request with a seed draws its noise from its own
torch.Generator and gets the same tokens whichever batch it runs in. Logprobs are the model's raw
log-probabilities (before penalties, temperature and truncation).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import Sequence


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the n most likely tokens and their logprobs, most likely first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}  # for rows without their own seed

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """`logits` [R, vocab] float32, row r for `seqs[r]`."""
        params = [s.params for s in seqs]
        want_logprobs = [p.logprobs is not None for p in params]
        if all(p.greedy and not p.has_penalties for p in params) and not any(want_logprobs):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(seqs))  # the fast path
        raw = logits
        if any(p.has_penalties for p in params):
            logits = apply_penalties(logits.clone(), seqs)
        tokens = self._sample(logits, seqs)
        return SamplerOutput(tokens.tolist(), gather_logprobs(raw, tokens, [p.logprobs for p in params]))

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            picked = [seqs[i] for i in rows]
            probs = truncated_probs(logits[index], [s.params for s in picked])
            tokens[index] = (probs / self._noise(probs, picked)).argmax(dim=-1)
        return tokens

    def _noise(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Exp(1) noise [R, vocab]: seeded rows from their own generator, the rest from the engine's."""
        noise = torch.empty_like(probs)
        shared = [i for i, s in enumerate(seqs) if s.params.seed is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_(
                generator=self._shared_generator(probs.device))
        for i, seq in enumerate(seqs):
            if seq.params.seed is not None:
                if seq.generator is None:
                    seq.generator = torch.Generator(device=probs.device).manual_seed(seq.params.seed)
                noise[i].exponential_(generator=seq.generator)
        return noise

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Penalised `logits` [R, vocab]. Repetition divides positive logits (multiplies negative
    ones) of every token seen in prompt or output; presence subtracts a constant and frequency a
    multiple of the count, for tokens in the output."""
    R, V = logits.shape
    counts = torch.zeros(R, V, device=logits.device)
    seen = torch.zeros(R, V, dtype=torch.bool, device=logits.device)
    for r, seq in enumerate(seqs):
        out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
        counts[r].index_add_(0, out, torch.ones(len(out), device=logits.device))
        seen[r, torch.tensor(seq.token_ids, dtype=torch.long, device=logits.device)] = True

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(s.params, name) for s in seqs], device=logits.device)[:, None]

    rep = column("repetition_penalty").expand(R, V)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits -= column("frequency_penalty") * counts + column("presence_penalty") * (counts > 0)
    return logits


def truncated_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Probabilities [R, vocab] after temperature, top-k, top-p and min-p (masked tokens get 0)."""
    device = logits.device
    logits = logits / torch.tensor([p.temperature for p in params], device=device)[:, None]
    V = logits.shape[1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    if (top_k < V).any() or (top_p < 1.0).any():
        ordered, order = logits.sort(dim=-1, descending=True)  # [R, V]
        drop = torch.arange(V, device=device)[None, :] >= top_k[:, None]
        ordered = ordered.masked_fill(drop, float("-inf"))
        probs = ordered.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the most likely token is always kept
        ordered = ordered.masked_fill(mass_before > top_p[:, None], float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, ordered)
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
    if (min_p > 0).any():
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: list[int | None]) -> list[TokenLogprobs | None]:
    rows = [i for i, n in enumerate(top_n) if n is not None]
    result: list[TokenLogprobs | None] = [None] * len(top_n)
    if not rows:
        return result
    index = torch.tensor(rows, device=logits.device)
    logprobs = logits[index].float().log_softmax(dim=-1)  # [R', V]
    chosen = logprobs.gather(1, tokens[index][:, None])[:, 0].tolist()
    top_values, top_ids = logprobs.topk(max(top_n[i] for i in rows), dim=-1)
    for j, i in enumerate(rows):
        n = top_n[i]
        top = list(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist()))
        result[i] = TokenLogprobs(int(tokens[i]), chosen[j], top)
    return result
