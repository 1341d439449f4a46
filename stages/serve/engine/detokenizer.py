"""Incremental detokenisation and stop strings: text deltas that are safe to show.

A byte-level BPE token can end in the middle of a UTF-8 character (an emoji spans several
tokens), and a piece of text can be the start of a stop string. Neither may leave the engine
early: the first is held until the character completes, the second until it is either a whole
stop string (then the text ends before it) or can no longer become one.
"""
from __future__ import annotations

from .config import SamplingParams

REPLACEMENT = "\ufffd"  # what decode() gives for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Decodes a small window of trailing tokens at a time (a few tokens of context keep the
    tokenizer's spacing rules right) and releases text only once it ends in a whole character."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True, context: int = 5):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids)
        self.prefix_offset = max(len(self.token_ids) - context, 0)  # window start
        self.read_offset = len(self.token_ids)  # tokens before this are already in the text

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        prefix, full = self._decode_window()
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end), as decoded."""
        prefix, full = self._decode_window()
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full[len(prefix):]

    def _decode_window(self) -> tuple[str, str]:
        window = self.token_ids[self.prefix_offset:]
        read = self.read_offset - self.prefix_offset
        decode = self.tokenizer.decode
        return (decode(window[:read], skip_special_tokens=self.skip_special_tokens),
                decode(window, skip_special_tokens=self.skip_special_tokens))


class StopStrings:
    """Cuts text at the first stop string and holds back a tail that could still become one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.text = ""  # everything received (up to the stop string once one is found)
        self.emitted = 0  # characters of `text` already released
        self.stopped = False

    def feed(self, delta: str) -> str:
        if self.stopped or not delta:
            return ""
        start = max(0, len(self.text) - self.longest + 1)  # a new match must end in the new text
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.text = self.text[:min(hits)]
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held())

    def flush(self) -> str:
        return self._release(len(self.text))

    def _held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        for k in range(min(self.longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self.emitted)
        out, self.emitted = self.text[self.emitted:end], end
        return out


class OutputText:
    """One request's output text: detokenizer plus stop strings. `add` and `finish` return the text
    they release; `take_delta` gives what was released since it was last called (one output's worth)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.stop = StopStrings(params.stop)
        self.taken = 0  # characters of the released text already handed out by take_delta

    @property
    def text(self) -> str:
        """The text released so far."""
        return self.stop.text[:self.stop.emitted]

    @property
    def stopped(self) -> bool:
        """A stop string was found: the request is done."""
        return self.stop.stopped

    def add(self, token_id: int) -> str:
        return self.stop.feed(self.detokenizer.add(token_id))

    def finish(self) -> str:
        """The rest of the text once the request ends for another reason (EOS, length)."""
        delta = self.stop.feed(self.detokenizer.flush())
        return delta + self.stop.flush()

    def take_delta(self) -> str:
        delta = self.stop.text[self.taken:self.stop.emitted]
        self.taken = self.stop.emitted
        return delta
