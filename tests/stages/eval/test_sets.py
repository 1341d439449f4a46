"""The evaluation sets (texts.py) under the perplexity protocol: each set's first window is the same on every run,
the chat set carries its template's markup as special token ids, each protocol says what its text is, and a
text list splits into one config (and one metric key) per text."""
from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from llmopt.stages.errors import ConfigError, DataError
from llmopt.stages.eval.config import EvalConfig
from llmopt.stages.eval.measure import describe_text, evaluate
from llmopt.stages.eval.perplexity import tokenize_windows
from llmopt.stages.eval.texts import EVAL_SETS, eval_text, stdlib_files
from tests.helpers import make_chat_tokenizer, make_model

ROOT = Path(__file__).resolve().parents[3]
SEQLEN = 64
# The first ids of a set's first window with make_chat_tokenizer(), read from the shared data files: a change
# means the text or its tokenization changed, and with it every stored result of that set. (code has none here:
# its text is this interpreter's standard library, which another Python version changes.)
GOLDEN = {
    "wikitext2": [199, 199, 221, 29, 221, 50, 79, 66, 264, 84, 221, 34, 79, 85, 76, 84],
    "chat": [300, 85, 83, 264, 199, 52, 72, 82, 73, 86, 73, 78, 71, 221, 51, 276],  # 300: <|im_start|>
}


def first_window(name: str) -> list[int]:
    """The first window of set `name`, with a tokenizer built (and trained) anew."""
    tok = make_chat_tokenizer()
    windows, _ = tokenize_windows(tok, eval_text(name, tok).text, SEQLEN)
    return windows[0].tolist()


def test_each_sets_first_window_is_the_same_on_every_run():
    first = {name: first_window(name) for name in EVAL_SETS}
    script = ("import json; from tests.stages.eval.test_sets import EVAL_SETS, first_window; "
              "print(json.dumps({name: first_window(name) for name in EVAL_SETS}))")
    other = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert other.returncode == 0, other.stderr[-2000:]
    assert first == json.loads(other.stdout)  # another process: its own tokenizer, its own hash seed
    assert all(len(ids) == SEQLEN for ids in first.values())
    for name, ids in GOLDEN.items():
        assert first[name][:len(ids)] == ids, name


def test_the_chat_set_tokenizes_the_template_markup_as_special_tokens():
    tok = make_chat_tokenizer()
    text = eval_text("chat", tok)
    assert text.special_tokens_in_text and text.text.startswith("<|im_start|>user\n")
    ids = tok(text.text, add_special_tokens=False)["input_ids"]
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids[0] == start
    # each turn's markers are one special token each, never their characters: one pair per prompt
    assert ids.count(start) == ids.count(end) == text.facts["prompts"] == text.text.count("<|im_start|>")
    windows, _ = tokenize_windows(tok, text.text, SEQLEN)
    assert windows[0, 0].item() == start


def test_the_code_sets_protocol_names_the_python_version_and_file_count():
    tok = make_chat_tokenizer()
    result = evaluate(make_model(len(tok)), tok, EvalConfig(text="code", seqlen=SEQLEN, max_windows=1))
    p, version, files = result.protocol, platform.python_version(), len(stdlib_files()[0::2])
    assert (p["text"], p["python"], p["files"]) == ("code", version, files)
    assert result.windows == 1 and result.windows_available > 100
    line = describe_text(p)
    assert f"Python {version} standard library" in line and f"{files:,} .py files at even positions" in line
    wiki = evaluate(make_model(len(tok)), tok, EvalConfig(seqlen=SEQLEN, max_windows=1)).protocol
    assert wiki["text_path"].endswith("wiki.test.raw") and describe_text(wiki).endswith("rows joined by '\\n\\n'")


def test_a_text_list_gives_one_config_and_metric_key_per_text(tmp_path):
    config = EvalConfig(text="wikitext2, code", seqlen=64, max_windows=2)
    assert config.texts() == ("wikitext2", "code") and [c.text for c in config.split()] == ["wikitext2", "code"]
    keys = [c.metric_key() for c in EvalConfig(text="all", seqlen=64, max_windows=2).split()]
    assert keys == ["eval/wikitext2/seqlen64/windows-2", f"eval/code-py{platform.python_version()}/seqlen64/windows-2",
                    "eval/chat/seqlen64/windows-2"]
    with pytest.raises(ValueError, match="split"):
        config.metric_key()
    odd = tmp_path / "a,b.txt"
    odd.write_text("a file whose name holds a comma is one text\n")
    assert EvalConfig(text=str(odd)).texts() == (str(odd),)
    for bad, why in (("wikitext2,wikitext2", "each text once"), ("wikitext2,,code", "each text once"),
                     ("code,all", "every set")):
        with pytest.raises(ConfigError, match=why):
            EvalConfig(text=bad).validate()
    with pytest.raises(DataError, match=r"--text nope: no such text file and not a built-in name \(.*code, chat"):
        EvalConfig.from_options({"text": "wikitext2,nope"})
    assert EvalConfig.from_options({"text": "code,chat"}).texts() == ("code", "chat")
