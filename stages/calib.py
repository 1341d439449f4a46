"""Calibration data for quantize and prune: token windows [nsamples, seqlen], seeded.

Kinds: a built-in text (`wikitext2-valid`) or a text file (GPTQ protocol: HF rows joined by
"\\n\\n", random windows), a ShareGPT-style JSON (each first user turn through the chat template,
concatenated; the built-in `sharegpt` takes the prompts at even positions, the `chat` evaluation set the
others), `code` (the standard library files the `code` evaluation set does not score: eval/texts.py), or
`self` (sequences sampled from the model itself, so no data is needed).

A mix, `--calib wikitext2-valid:0.3,sharegpt:0.5,code:0.2`, draws each part's share of the windows (largest
remainders: 128 windows at 0.3/0.5/0.2 are 38/64/26) from that part at seeded random offsets (seed + the part's
position), then shuffles them all with the seed: the same mix, sizes and seed give the same windows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from .data import BUILTIN_FILES, BUILTIN_TEXTS, resolve_file, resolve_text
from .errors import ConfigError, DataError
from .options import Option

CODE = "code"  # the stdlib files eval/texts.py's `code` set leaves out
AUTO = "auto"  # the default: CHAT_MIX for a model with a chat template, else PLAIN
PLAIN = "wikitext2-valid"
# What a chat model is calibrated on by default: of the mixes scripts/calib_domains.py (make quality-domains) scored
# on wikitext2, code and chat, the one whose worst set kept the most of GPTQ's gain (docs/results.md, "Quantization
# quality off the calibration domain": 49% / 60% / 51% of RTN's increase removed, 0.3/0.5/0.2 gave 47% / 58% / 48%).
CHAT_MIX = "wikitext2-valid:1,sharegpt:1,code:1"  # equal thirds
EVAL_ONLY = {"wikitext2": "the WikiText-2 test split; calibrate on wikitext2-valid (never on test data)",
             "chat": "the chat evaluation set; calibrate on sharegpt (the other half of its prompts)"}

if TYPE_CHECKING:  # torch is imported where data is made: the config is read by `llmopt --help`
    import torch


@dataclass(frozen=True)
class CalibConfig:
    """Which calibration data, how many windows of how many tokens, and the sampling seed."""

    calib: str = AUTO
    nsamples: int = 128
    seqlen: int = 2048
    seed: int = 0

    @classmethod
    def options(cls) -> tuple[Option, ...]:
        """The calibration options of quantize and prune (--calib, --nsamples, --seqlen, --seed)."""
        d = cls()
        return (Option("calib", str, d.calib), Option("nsamples", int, d.nsamples), Option("seqlen", int, d.seqlen),
                Option("seed", int, d.seed))

    @classmethod
    def from_values(cls, values: Mapping[str, object]) -> "CalibConfig":
        """The config from a stage's option values (its calibration options among them)."""
        return cls(values["calib"], values["nsamples"], values["seqlen"], values["seed"])

    def validate(self) -> None:
        parts = parse_mix(self.calib)
        for name, _ in parts:
            if name in EVAL_ONLY:
                raise ConfigError(f"--calib {name} is {EVAL_ONLY[name]}")
            if name == "self" and len(parts) > 1:
                raise ConfigError("--calib self samples the model itself and cannot be mixed with data")
        if self.nsamples < 1 or self.seqlen < 2:
            raise ConfigError(f"--nsamples must be >= 1 and --seqlen >= 2 (got {self.nsamples}, {self.seqlen})")
        if len(parts) > 1 and self.nsamples < len(parts):
            raise ConfigError(f"--calib mixes {len(parts)} parts: give --nsamples of at least {len(parts)}")

    def describe(self) -> dict:
        record = {"calib": self.calib, "nsamples": self.nsamples, "seqlen": self.seqlen, "seed": self.seed}
        parts = parse_mix(self.calib)
        if len(parts) > 1:
            record["mix"] = {name: count for (name, _), count in zip(parts, mix_counts(parts, self.nsamples))}
        return record


def resolve_calib(config: CalibConfig, tokenizer) -> CalibConfig:
    """`config` with `auto` made what it means for this tokenizer (CHAT_MIX with a chat template, else PLAIN), so
    that a manifest records the data that was used."""
    if config.calib != AUTO:
        return config
    chosen = CHAT_MIX if getattr(tokenizer, "chat_template", None) else PLAIN
    return CalibConfig(chosen, config.nsamples, config.seqlen, config.seed)


def parse_mix(calib: str) -> list[tuple[str, float]]:
    """`--calib`'s parts and their weights (summing to 1): one name or file, or NAME:WEIGHT,NAME:WEIGHT,..."""
    if ":" not in calib or Path(calib).expanduser().is_file():
        return [(calib, 1.0)]
    parts = []
    for item in calib.split(","):
        name, sep, weight = item.strip().rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not sep or not name or not (0 < value < math.inf):
            raise ConfigError(f"--calib {calib!r}: write one name or file, or a mix NAME:WEIGHT,NAME:WEIGHT with "
                              f"positive weights (e.g. wikitext2-valid:0.3,sharegpt:0.5,code:0.2); {item!r} is not one")
        parts.append((name, value))
    names = [name for name, _ in parts]
    if len(set(names)) < len(names):
        raise ConfigError(f"--calib {calib!r}: each part once")
    total = sum(w for _, w in parts)
    return [(name, w / total) for name, w in parts]


def mix_counts(parts: list[tuple[str, float]], nsamples: int) -> list[int]:
    """Each part's number of windows: its share of `nsamples`, rounded by largest remainders (ties: the earlier
    part), at least one each."""
    exact = [w * nsamples for _, w in parts]
    counts = [max(1, math.floor(x)) for x in exact]
    order = sorted(range(len(parts)), key=lambda i: (-(exact[i] - math.floor(exact[i])), i))
    for i in order[:max(0, nsamples - sum(counts))]:
        counts[i] += 1
    while sum(counts) > nsamples:  # the at-least-one rule took some: give back from the largest
        counts[counts.index(max(counts))] -= 1
    return counts


def calibration_windows(tokenizer, config: CalibConfig, model=None) -> torch.Tensor:
    """Token ids [nsamples, seqlen] for the configured calibration data (`auto` resolved for `tokenizer`)."""
    config = resolve_calib(config, tokenizer)
    config.validate()
    if config.calib == "self":
        if model is None:
            raise ConfigError("--calib self needs the model")
        return sample_from_model(model, tokenizer, config)
    parts = parse_mix(config.calib)
    if len(parts) == 1:
        return random_windows(_token_stream(tokenizer, config.calib), config.nsamples, config.seqlen, config.seed)
    return mixed_windows([_token_stream(tokenizer, name) for name, _ in parts], mix_counts(parts, config.nsamples),
                         config.seqlen, config.seed)


def mixed_windows(streams: list[torch.Tensor], counts: list[int], seqlen: int, seed: int) -> torch.Tensor:
    """`counts[i]` windows from `streams[i]` (seeded with seed + i), all of them shuffled with `seed`."""
    import torch

    windows = torch.cat([random_windows(stream, count, seqlen, seed + i)
                         for i, (stream, count) in enumerate(zip(streams, counts))])
    return windows[torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed))]


def _token_stream(tokenizer, calib: str) -> torch.Tensor:
    import torch

    from .eval.perplexity import build_text
    from .eval.texts import code_calibration_text

    if calib == CODE:
        text = code_calibration_text()
    elif calib in BUILTIN_FILES or calib.endswith(".json"):
        return _sharegpt_stream(tokenizer, resolve_file(calib), builtin=calib in BUILTIN_FILES)
    elif calib not in BUILTIN_TEXTS and not Path(calib).expanduser().is_file():
        known = ", ".join([*BUILTIN_TEXTS, *BUILTIN_FILES, CODE, "self"])
        raise DataError(f"--calib {calib}: no such file and not a built-in name ({known})")
    else:
        text = build_text(resolve_text(calib))
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def _sharegpt_stream(tokenizer, path: Path, builtin: bool = False) -> torch.Tensor:
    """Each first user turn through the chat template (else the prompt and EOS), concatenated; of the built-in
    file, the prompts at even positions only (the `chat` evaluation set scores the others)."""
    import torch

    from .eval.texts import sharegpt_prompts

    prompts = sharegpt_prompts(path)
    if builtin:
        prompts = prompts[0::2]
    ids: list[int] = []
    for prompt in prompts:
        msgs = [{"role": "user", "content": prompt}]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        else:
            text = prompt + (tokenizer.eos_token or "")
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def random_windows(stream: torch.Tensor, nsamples: int, seqlen: int, seed: int) -> torch.Tensor:
    """`nsamples` windows at seeded random offsets (the usual GPTQ calibration sampling)."""
    import torch

    if stream.numel() <= seqlen:
        raise DataError(f"calibration data has {stream.numel()} tokens, not more than one window of {seqlen}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - seqlen, (nsamples,), generator=gen)
    return torch.stack([stream[s:s + seqlen] for s in starts.tolist()])  # [n, S]


def sample_from_model(model, tokenizer, config: CalibConfig, batch: int = 16) -> torch.Tensor:
    """Sequences generated by the model from its BOS (or a random token), temperature 1, seeded."""
    import torch

    torch.manual_seed(config.seed)
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0
    out = []
    with torch.inference_mode():
        for i in range(0, config.nsamples, batch):
            n = min(batch, config.nsamples - i)
            ids = torch.full((n, 1), start, dtype=torch.long)
            gen = model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=config.seqlen - 1, min_new_tokens=config.seqlen - 1)
            out.append(gen[:, : config.seqlen])
    return torch.cat(out)
