"""Calibration mixes (`--calib NAME:WEIGHT,...`): parsing, each part's share, determinism by seed, the held-out
halves of the built-in sets, and chat samples rendered with the template's special tokens."""
from __future__ import annotations

import pytest
import torch

from llmopt.stages.calib import (CalibConfig, calibration_windows, mix_counts, mixed_windows, parse_mix,
                                 random_windows)
from llmopt.stages.errors import ConfigError

from tests.helpers import make_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_tokenizer():
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_a_mix_parses_into_normalized_weights():
    assert parse_mix("wikitext2-valid") == [("wikitext2-valid", 1.0)]
    assert parse_mix("wikitext2-valid:3,sharegpt:5,code:2") == [("wikitext2-valid", 0.3), ("sharegpt", 0.5),
                                                                 ("code", 0.2)]
    for bad in ("a:0,b:1", "a:x,b:1", "a:1,a:2", ":1,b:1", "a:1,b:inf", "a:-1,b:2"):
        with pytest.raises(ConfigError, match="--calib"):
            parse_mix(bad)


def test_each_part_gets_its_share_by_largest_remainders():
    parts = parse_mix("a:0.3,b:0.5,c:0.2")
    assert mix_counts(parts, 128) == [38, 64, 26] and sum(mix_counts(parts, 7)) == 7
    assert mix_counts(parse_mix("a:0.98,b:0.01,c:0.01"), 4) == [2, 1, 1]  # every part keeps one window
    assert mix_counts(parse_mix("a:1,b:1,c:1"), 128) == [43, 43, 42]


def test_a_mix_refuses_test_data_and_self():
    for calib, why in (("wikitext2-valid:1,wikitext2:1", "test split"), ("sharegpt:1,chat:1", "evaluation set"),
                       ("self:1,code:1", "cannot be mixed")):
        with pytest.raises(ConfigError, match=why):
            CalibConfig(calib=calib).validate()
    with pytest.raises(ConfigError, match="at least 3"):
        CalibConfig(calib="a:1,b:1,c:1", nsamples=2).validate()
    assert CalibConfig(calib="wikitext2-valid:0.3,sharegpt:0.5,code:0.2").describe()["mix"] == {
        "wikitext2-valid": 38, "sharegpt": 64, "code": 26}


def test_mixed_windows_are_deterministic_for_a_seed_and_shuffled():
    streams = [torch.arange(0, 1000), torch.arange(10_000, 11_000), torch.arange(20_000, 21_000)]
    a = mixed_windows(streams, [3, 5, 2], 16, seed=7)
    assert torch.equal(a, mixed_windows(streams, [3, 5, 2], 16, seed=7)) and a.shape == (10, 16)
    assert not torch.equal(a, mixed_windows(streams, [3, 5, 2], 16, seed=8))
    parts = (a[:, 0] // 10_000).tolist()
    assert sorted(parts) == [0] * 3 + [1] * 5 + [2] * 2 and parts != sorted(parts)  # each share, mixed up
    first = random_windows(streams[0], 3, 16, seed=7)  # part i draws with seed + i, as alone
    assert sorted(map(tuple, first.tolist())) == sorted(tuple(w) for w in a.tolist() if w[0] < 10_000)


def test_a_mix_of_built_in_sets_through_the_tokenizer(chat_tokenizer):
    config = CalibConfig(calib="wikitext2-valid:0.5,sharegpt:0.25,code:0.25", nsamples=8, seqlen=64, seed=3)
    windows = calibration_windows(chat_tokenizer, config)
    assert windows.shape == (8, 64) and torch.equal(windows, calibration_windows(chat_tokenizer, config))
    start = chat_tokenizer.convert_tokens_to_ids("<|im_start|>")
    sharegpt = calibration_windows(chat_tokenizer, CalibConfig(calib="sharegpt", nsamples=4, seqlen=64))
    assert (sharegpt == start).any()  # chat samples carry the template's special tokens, as ids
    assert (windows == start).sum() > 0


def test_calibration_halves_never_share_text_with_the_evaluation_sets(chat_tokenizer):
    from llmopt.stages.eval.texts import code_calibration_text, eval_text, sharegpt_prompts, stdlib_files

    files = stdlib_files()
    assert len(files) > 100 and files == sorted(files, key=lambda p: p.as_posix())
    prompts = sharegpt_prompts()
    chat = eval_text("chat", chat_tokenizer).text
    assert prompts[1][:40] in chat and prompts[0] not in chat  # odd prompts scored, even ones calibrate
    code = code_calibration_text()
    assert files[1].read_text(encoding="utf-8", errors="replace") in code
    scored = next(f.read_text(encoding="utf-8", errors="replace") for f in files[0::2] if f.stat().st_size > 4000)
    assert scored[:4000] not in code  # a file the code set scores is not calibration text
