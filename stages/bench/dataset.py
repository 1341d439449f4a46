"""Prompts to send: ShareGPT files, JSON lines, random prompts of a given length, input-grounded prompts, or
groups of prompts sharing a prefix.

`grounded` (or grounded:FILE, a ShareGPT file) asks the model to repeat or lightly edit a passage it is given,
the passage being a ShareGPT prompt: output that copies its input, where n-gram speculation pays off.

`shared-prefix` (or shared-prefix:G,P) is SGLang's "generated shared prefix" workload: G groups (default 8),
each a random P-token system prompt (default 512) followed by distinct random questions of `input_len` tokens;
`num_prompts` questions in all, spread over the groups, shuffled by `seed` (group by group with
`--disable-shuffle`). Where requests land decides how much of the prefix a server finds in its cache: what
cache-aware routing is measured on.

Prompt lengths in tokens are known when a tokenizer is given (`--tokenizer SOURCE`) or for random
prompts; otherwise the server's reported usage fills them in. ShareGPT records without a reply
(like the shared 500-prompt file) take `output_len`.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, DataError

DEFAULT_OUTPUT_LEN = 128
# Short, common English words: one token each in most BPE vocabularies (plus the leading space).
WORDS = ("the of and to in is was for on are with as by at be this from that have or it not but all "
         "can more one time new some which about than other into year most only over state also after "
         "world work first made people water light house city paper music river number point small "
         "large green table field story plant south north market group order model power voice").split()


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int | None  # tokens, when known before sending
    output_len: int  # max_tokens to ask for


@dataclass(frozen=True)
class DatasetConfig:
    """spec: random | sharegpt | sharegpt:FILE | grounded | grounded:FILE | jsonl:FILE | shared-prefix |
    shared-prefix:GROUPS,PREFIX_LEN."""

    spec: str = "random"
    num_prompts: int = 100
    input_len: int = 128  # random: prompt tokens; shared-prefix: each question's
    output_len: int | None = None  # None: the reply's length, else DEFAULT_OUTPUT_LEN
    seed: int = 0
    tokenizer: str | None = None  # a model source whose tokenizer counts (and makes) tokens
    shuffle: bool = True  # file records shuffled by `seed`; False: the first num_prompts in file order

    def validate(self) -> None:
        kind, _, where = self.spec.partition(":")
        if kind not in ("random", "sharegpt", "grounded", "jsonl", "shared-prefix") or (kind == "jsonl" and not where):
            raise ConfigError(f"--dataset {self.spec!r}: use random, sharegpt, sharegpt:FILE, grounded, "
                              "grounded:FILE, jsonl:FILE, shared-prefix or shared-prefix:GROUPS,PREFIX_LEN")
        if kind == "shared-prefix":
            shared_prefix_shape(where)
        if self.num_prompts < 1 or self.input_len < 1 or (self.output_len is not None and self.output_len < 1):
            raise ConfigError("--num-prompts, --input-len and --output-len must be at least 1")

    def describe(self) -> dict:
        generated = self.spec == "random" or self.spec.startswith("shared-prefix")
        return {"dataset": self.spec, "num_prompts": self.num_prompts, "tokenizer": self.tokenizer,
                "input_len": self.input_len if generated else None, "output_len": self.output_len,
                "shuffle": self.shuffle}


SHARED_PREFIX = (8, 512)  # shared-prefix's groups and prefix tokens when the spec gives none


def shared_prefix_shape(where: str) -> tuple[int, int]:
    """(groups, prefix tokens) of a shared-prefix spec's part after the colon ("" for the defaults)."""
    if not where:
        return SHARED_PREFIX
    parts = where.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise ConfigError(f"--dataset shared-prefix:{where}: give GROUPS,PREFIX_LEN as two positive integers "
                          "(shared-prefix:8,512)")
    return int(parts[0]), int(parts[1])


VLLM_DATASETS = {"custom": "jsonl"}  # vLLM's --dataset-name for ours, where they differ


def dataset_spec(name: str, path: str | None = None) -> str:
    """--dataset (or vLLM's --dataset-name) with vLLM's --dataset-path: 'sharegpt' + 'F.json' -> 'sharegpt:F.json'."""
    name = VLLM_DATASETS.get(name, name)
    if path is None:
        return name
    if ":" in name or name == "random":
        raise ConfigError(f"--dataset-path {path}: --dataset {name} reads no file; give --dataset-name sharegpt, "
                          "grounded or custom (JSON lines)")
    return f"{name}:{path}"


def load_requests(config: DatasetConfig, tokenizer=None) -> list[BenchRequest]:
    """`num_prompts` requests, shuffled by `seed` unless `shuffle` is off (records repeat if the file holds fewer)."""
    config.validate()
    rng = random.Random(config.seed)
    kind, _, where = config.spec.partition(":")
    if kind == "random":
        return [_random_request(rng, config, tokenizer) for _ in range(config.num_prompts)]
    if kind == "shared-prefix":
        return _shared_prefix_requests(rng, config, tokenizer, *shared_prefix_shape(where))
    if kind == "jsonl":
        pairs = _jsonl_records(where)
    else:
        pairs = _sharegpt_pairs(where or "sharegpt")
        pairs = grounded_pairs(pairs, config.seed) if kind == "grounded" else pairs
    order = list(range(len(pairs)))
    if config.shuffle:
        rng.shuffle(order)
    picked = [pairs[order[i % len(order)]] for i in range(config.num_prompts)]
    return [_request(prompt, reply, config, tokenizer) for prompt, reply in picked]


def load_tokenizer(source: str):
    """The tokenizer of any model source (an alias is imported once, then read from the cache)."""
    from ..model_io import load_tokenizer as load
    from ..source import as_artifact, resolve

    resolved = resolve(source)
    art = as_artifact(resolved)
    return load(art.path if art else resolved.path)


def _request(prompt: str, reply: str | int | None, config: DatasetConfig, tokenizer) -> BenchRequest:
    if config.output_len is not None:
        output_len = config.output_len
    elif isinstance(reply, int):
        output_len = reply
    elif reply:  # without a tokenizer, ~4 characters per token
        output_len = _count(tokenizer, reply) if tokenizer else max(1, round(len(reply) / 4))
    else:
        output_len = DEFAULT_OUTPUT_LEN
    return BenchRequest(prompt, _count(tokenizer, prompt) if tokenizer else None, output_len)


def _random_request(rng: random.Random, config: DatasetConfig, tokenizer) -> BenchRequest:
    text = _random_text(rng, config.input_len, tokenizer)
    return BenchRequest(text, _count(tokenizer, text) if tokenizer else config.input_len,
                        config.output_len or DEFAULT_OUTPUT_LEN)


def _random_text(rng: random.Random, tokens: int, tokenizer) -> str:
    """About `tokens` tokens of random text: common words (a token each), or the tokenizer's random ids decoded."""
    if tokenizer is None:
        return " ".join(rng.choice(WORDS) for _ in range(tokens))
    special = set(tokenizer.all_special_ids)
    usable = [i for i in range(len(tokenizer)) if i not in special]
    return tokenizer.decode([rng.choice(usable) for _ in range(tokens)])


def _shared_prefix_requests(rng: random.Random, config: DatasetConfig, tokenizer, groups: int,
                            prefix_len: int) -> list[BenchRequest]:
    """`num_prompts` prompts, question i in group i % groups: that group's prefix, a blank line, the question."""
    prefixes = [_random_text(rng, prefix_len, tokenizer) for _ in range(groups)]
    by_group = sorted(range(config.num_prompts), key=lambda i: i % groups)  # group 0's questions first
    prompts = [f"{prefixes[i % groups]}\n\n{_random_text(rng, config.input_len, tokenizer)}" for i in by_group]
    if config.shuffle:
        rng.shuffle(prompts)
    output_len = config.output_len or DEFAULT_OUTPUT_LEN
    return [BenchRequest(p, _count(tokenizer, p) if tokenizer else prefix_len + config.input_len, output_len)
            for p in prompts]


def _count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _sharegpt_pairs(name_or_path: str) -> list[tuple[str, str | None]]:
    from ..data import resolve_file

    path = resolve_file(name_or_path)
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a ShareGPT JSON file ({e})") from None
    pairs = [pair for pair in map(_first_turn, records if isinstance(records, list) else []) if pair]
    if not pairs:
        raise DataError(f"{path}: no ShareGPT records with a human first turn "
                        '(expected [{"conversations": [{"from": "human", "value": ...}]}])')
    return pairs


def _first_turn(record) -> tuple[str, str | None] | None:
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
        return None
    if turns[0].get("from") not in ("human", "user") or not turns[0].get("value"):
        return None
    reply = turns[1].get("value") if len(turns) > 1 and isinstance(turns[1], dict) else None
    return str(turns[0]["value"]), (str(reply) if reply else None)


GROUNDED_TASKS = (  # how a small instruct model (SmolLM2-135M) copies most: proofreading, and a request after the text
    "Proofread this text and output the corrected version in full:\n\n{passage}",
    "{passage}\n\nRepeat the text above word for word.",
    "Fix any spelling mistakes in the following text and output the whole text:\n\n{passage}",
    'Text:\n"""\n{passage}\n"""\nCopy the text above exactly.',
)
GROUNDED_CHARS = (200, 2000)  # passages of this many characters: long enough to copy, short enough for the context


def grounded_pairs(pairs: list[tuple[str, str | None]], seed: int) -> list[tuple[str, str]]:
    """(prompt, expected reply) pairs asking to repeat or edit a passage, each passage a ShareGPT prompt of
    GROUNDED_CHARS; the task of each is drawn by `seed`. The reply's length (the passage's) sets max_tokens."""
    rng = random.Random(f"grounded-{seed}")
    low, high = GROUNDED_CHARS
    passages = [p.strip() for p, _ in pairs if low <= len(p.strip()) <= high]
    if not passages:
        raise DataError(f"no ShareGPT prompt of {low}-{high} characters to build grounded prompts from")
    return [(rng.choice(GROUNDED_TASKS).format(passage=passage), passage) for passage in passages]


def _jsonl_records(path_text: str) -> list[tuple[str, int | None]]:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise DataError(f"{path_text}: no such JSON lines file")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            records.append(_jsonl_record(line, f"{path}:{number}"))
    if not records:
        raise DataError(f"{path}: no records (one JSON object per line: {{\"prompt\": ..., \"output_len\": ...}})")
    return records


def _jsonl_record(line: str, where: str) -> tuple[str, int | None]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not JSON ({e.msg})") from None
    prompt = obj.get("prompt") if isinstance(obj, dict) else None
    if not isinstance(prompt, str) or not prompt:
        raise DataError(f'{where}: needs a "prompt" string')
    length = obj.get("output_len", obj.get("max_tokens"))
    if length is not None and (not isinstance(length, int) or length < 1):
        raise DataError(f'{where}: "output_len" must be a positive integer')
    return prompt, length
