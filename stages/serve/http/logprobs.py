"""Logprobs in the two OpenAI shapes: the legacy completions one and the chat `content` list."""
from __future__ import annotations

import math

FLOOR = -9999.0  # JSON has no -Infinity


def _lp(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(entries, tokenizer, text_offset: int = 0) -> dict:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}; offsets count from `text_offset`."""
    result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        token = _text(tokenizer, entry.token_id)
        top = {_text(tokenizer, t): _lp(lp) for t, lp in entry.top}
        top.setdefault(token, _lp(entry.logprob))  # OpenAI lists the chosen token too
        result["tokens"].append(token)
        result["token_logprobs"].append(_lp(entry.logprob))
        result["top_logprobs"].append(top)
        result["text_offset"].append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(entries, tokenizer) -> dict:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}."""
    def item(token_id: int, logprob: float) -> dict:
        token = _text(tokenizer, token_id)
        return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8"))}

    return {"content": [item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}
