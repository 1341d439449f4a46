"""When a sequence ends: the one place that decides, after each new token, whether and why."""
from __future__ import annotations

from .sequence import Sequence


def append_token(seq: Sequence, token_id: int, max_model_len: int) -> str | None:
    """Add a sampled token to `seq` (and to its text) and return why the sequence ends with it:
    "stop" for a stop token, EOS (unless ignore_eos) or a stop string in the text, "length" for
    max_tokens or max_model_len; None while it goes on.

    A stop token is not part of the text. When a token both reaches the length and completes a
    stop string, the reason is "length" (the text is cut at the stop string either way)."""
    seq.append_token(token_id)
    params, text = seq.params, seq.output_text
    if token_id in params.stop_token_ids or (token_id in seq.eos_token_ids and not params.ignore_eos):
        reason = "stop"
    else:
        if text is not None:
            text.add(token_id)
        reason = _length_reason(seq, max_model_len) or ("stop" if text is not None and text.stopped else None)
    if reason is not None and text is not None:
        text.finish()  # release what the detokenizer or a possible stop string still held back
    return reason


def _length_reason(seq: Sequence, max_model_len: int) -> str | None:
    max_tokens = seq.params.max_tokens
    if (max_tokens is not None and seq.num_output_tokens >= max_tokens) or seq.num_tokens >= max_model_len:
        return "length"
    return None
