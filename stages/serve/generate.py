"""Offline batch generation through the serve engine, resumable.

Input: JSON lines `{"id": ..., "prompt": "..."}` or `{"id": ..., "messages": [...]}` (chat
template). Output: one JSON line per finished request, appended and flushed as it finishes, so an
interrupted run loses at most the requests in flight; a rerun skips every id already written.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import DataError
from .engine.config import RequestRejected, SamplingParams

# `llmopt generate`'s sampling when no option is given: greedy, with room for a paragraph (the
# engine's own SamplingParams() keeps OpenAI's defaults, which the HTTP API follows).
DEFAULT_PARAMS = SamplingParams(max_tokens=128, temperature=0.0)


@dataclass(frozen=True)
class PromptRecord:
    id: object  # as given in the input (a string or a number); compared as a string
    prompt: str | None = None
    messages: list | None = None
    where: str = ""  # "prompts.jsonl line 3", for error messages

    @property
    def key(self) -> str:
        return str(self.id)


@dataclass
class GenerateReport:
    total: int  # records in the input
    skipped: int  # already in the output before this run
    written: int
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    spec_verify_steps: int = 0  # speculative decoding: verify steps with drafts, drafts, drafts accepted
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Drafts accepted per draft proposed (None without speculation)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verify step appended on average (accepted drafts plus the target's own)."""
        return 1 + self.spec_accepted_tokens / self.spec_verify_steps if self.spec_verify_steps else None


def read_prompts(path: Path) -> list[PromptRecord]:
    """Every record of a JSON-lines prompt file; DataError naming the line for anything malformed."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such prompts file")
    records, seen = [], set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            record = _record(_loads(line), f"{path.name} line {number}")
            if record.key in seen:
                raise DataError(f"{record.where}: id {record.id!r} appears twice; ids must be unique")
            seen.add(record.key)
            records.append(record)
    if not records:
        raise DataError(f"{path}: no prompts in the file")
    return records


def _loads(line: str):
    """The JSON value of a line; None when it is not valid JSON."""
    try:
        return json.loads(line)
    except ValueError:
        return None


def _record(data, where: str) -> PromptRecord:
    if not isinstance(data, dict):
        raise DataError(f'{where}: not a JSON object; write {{"id": ..., "prompt": "..."}} '
                        'or {"id": ..., "messages": [...]}')
    if not isinstance(data.get("id"), (str, int)) or isinstance(data.get("id"), bool):
        raise DataError(f"{where}: needs an \"id\" (a string or an integer)")
    prompt, messages = data.get("prompt"), data.get("messages")
    if (prompt is None) == (messages is None):
        raise DataError(f"{where}: give exactly one of \"prompt\" (a string) or \"messages\" (a chat)")
    if prompt is not None and not isinstance(prompt, str):
        raise DataError(f"{where}: \"prompt\" must be a string")
    if messages is not None and not _is_chat(messages):
        raise DataError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": ..., \"content\": ...}}")
    return PromptRecord(data["id"], prompt, messages, where)


def _is_chat(messages) -> bool:
    return isinstance(messages, list) and bool(messages) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)


def completed_ids(output: Path) -> set[str]:
    """Ids already in `output`. A torn last line (the run was killed mid-write) is cut off."""
    output = Path(output)
    if not output.exists():
        return set()
    data = output.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[:data.rfind(b"\n") + 1]
        output.write_bytes(data)
    done = set()
    for number, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        result = _loads(line)
        if not isinstance(result, dict) or "id" not in result:
            raise DataError(f"{output} line {number}: not a generate result; fix or remove that line, or choose "
                            "another --output")
        done.add(str(result["id"]))
    return done


def prompt_token_ids(record: PromptRecord, tokenizer) -> list[int]:
    if record.prompt is not None:
        return tokenizer.encode(record.prompt)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{record.where}: \"messages\" needs a chat template, and this model's tokenizer has none; "
                        "give a \"prompt\" instead")
    text = tokenizer.apply_chat_template(record.messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


class GenerateJob:
    """The records of an input not yet in `output`, checked (a prompt that can never run fails
    here, before anything is generated); `run()` generates them, appending a line per request."""

    def __init__(self, engine, records: list[PromptRecord], output: Path, params: SamplingParams):
        self.engine, self.output = engine, Path(output)
        done = completed_ids(self.output)
        self.total = len(records)
        self.todo = {r.key: r for r in records if r.key not in done}
        self.requests = [_request(engine, r, params) for r in self.todo.values()]

    def run(self, on_progress: Callable[[int, int], None] = lambda done, total: None) -> GenerateReport:
        start, before = time.perf_counter(), self.engine.stats().spec
        report = GenerateReport(self.total, self.total - len(self.todo), 0, 0, 0, 0.0)
        on_progress(0, len(self.todo))
        self.output.parent.mkdir(parents=True, exist_ok=True)
        with open(self.output, "a", encoding="utf-8") as sink:
            for request in self.requests:
                self.engine.submit(request)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        sink.write(json.dumps(_result(self.todo[out.request_id], out), ensure_ascii=False) + "\n")
                        sink.flush()  # a killed run keeps every finished request
                        report.written += 1
                        report.prompt_tokens += out.num_prompt_tokens
                        report.completion_tokens += out.num_output_tokens
                        on_progress(report.written, len(self.todo))
        report.seconds = time.perf_counter() - start
        after = self.engine.stats().spec
        report.spec_verify_steps = after.num_drafts - before.num_drafts
        report.spec_draft_tokens = after.num_draft_tokens - before.num_draft_tokens
        report.spec_accepted_tokens = after.num_accepted_tokens - before.num_accepted_tokens
        return report


def _request(engine, record: PromptRecord, params: SamplingParams):
    try:
        ids = prompt_token_ids(record, engine.tokenizer)
        return engine.make_request(record.key, params=params, prompt_token_ids=ids)
    except RequestRejected as e:
        raise RequestRejected(f"{record.where} (id {record.id!r}): {e}") from None


def _result(record: PromptRecord, out) -> dict:
    return {"id": record.id, "text": out.text, "finish_reason": out.finish_reason,
            "prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens}


def generate_text(engine, prompt_ids: list[int], params: SamplingParams, on_delta: Callable[[str], None]):
    """One request, its text streamed through `on_delta`; the final RequestOutput."""
    engine.add_request("prompt", params=params, prompt_token_ids=prompt_ids)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            on_delta(out.delta_text)
            final = out
    return final
