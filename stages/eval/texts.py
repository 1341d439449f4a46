"""The texts perplexity is measured on, and their held-out calibration halves.

- `wikitext2` (test split) and `wikitext2-valid`, or any UTF-8 text file: rows joined by "\\n\\n" (perplexity.py).
- `code`: the Python standard library's own `.py` files (this interpreter's `sysconfig` stdlib folder; test
  folders and site-packages left out), in sorted path order, each file's text joined by "\\n\\n". Files at even
  positions of that order are the evaluation text; those at odd positions are calibration's `code`, so the two
  never share a file. The Python version is part of the protocol: another version's stdlib is another text.
- `chat`: the shared ShareGPT prompts (sharegpt/ShareGPT_V3_filtered_500.json, first human turn of each),
  each rendered through the model's chat template as a user turn, concatenated; the special tokens the
  template writes are tokenized as special tokens. Prompts at odd positions are the evaluation text; those at
  even positions are calibration's `sharegpt`. The file has no assistant replies, so the set scores the user
  turns a chat model reads, in the template it reads them in.

Every built-in set needs no download. `EVAL_SETS` is what `llmopt eval --text all` and quantize's before/after
report measure; each set's window count for the published tables is `TABLE_WINDOWS` (or all it has).
"""
from __future__ import annotations

import json
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from ..data import resolve_file, resolve_text
from ..errors import DataError

CODE, CHAT = "code", "chat"
EVAL_SETS = ("wikitext2", CODE, CHAT)  # the sets a quantization is scored on
TABLE_WINDOWS = 32
SHAREGPT = "sharegpt"
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclass(frozen=True)
class EvalText:
    """A text to score, and what it is (the protocol line's facts)."""
    name: str
    text: str
    special_tokens_in_text: bool = False  # the text holds template markup that tokenizes to special tokens
    facts: dict = field(default_factory=dict)


def eval_text(name: str, tokenizer) -> EvalText:
    """The evaluation text called `name`: a built-in set (code, chat) or a text name or file (wikitext2, ...)."""
    from .perplexity import build_text

    if name == CODE:
        files = stdlib_files()[0::2]
        return EvalText(CODE, join_files(files), facts=code_facts(files))
    if name == CHAT:
        prompts = sharegpt_prompts()[1::2]
        return EvalText(CHAT, chat_render(tokenizer, prompts, CHAT), special_tokens_in_text=True,
                        facts={"prompts": len(prompts), "file": str(resolve_file(SHAREGPT)),
                               "part": "odd positions (the even ones calibrate as sharegpt)"})
    path = resolve_text(name)
    return EvalText(name, build_text(path), facts={"text_path": str(path), "join": "\\n\\n"})


def is_builtin_set(name: str) -> bool:
    return name in (CODE, CHAT)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """Every `.py` file of the standard library, sorted by path, test folders and site-packages left out."""
    root = stdlib_root()
    files = [p for p in root.rglob("*.py") if not SKIPPED_DIRS & set(p.relative_to(root).parts)]
    if not files:
        raise DataError(f"no .py files under the standard library folder {root}")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def join_files(files: list[Path]) -> str:
    """The files' texts joined by "\\n\\n" (a file that is not UTF-8 is read with replacement characters)."""
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


def code_facts(files: list[Path]) -> dict:
    return {"python": platform.python_version(), "stdlib": str(stdlib_root()), "files": len(files),
            "part": "even positions in sorted path order (the odd ones calibrate as code)"}


def code_calibration_text() -> str:
    """Calibration's `code`: the stdlib files the `code` set does not score."""
    return join_files(stdlib_files()[1::2])


def sharegpt_prompts(path: Path | None = None) -> list[str]:
    """The first human turn of each ShareGPT-style conversation."""
    path = path or resolve_file(SHAREGPT)
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
        return [r["conversations"][0]["value"] for r in records]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, IndexError, TypeError) as e:
        raise DataError(f"{path}: not a ShareGPT-style JSON list of conversations ({e.__class__.__name__})") from None


def chat_render(tokenizer, prompts: list[str], what: str, add_generation_prompt: bool = False) -> str:
    """Each prompt as a user turn through the tokenizer's chat template, concatenated."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{what}: this model's tokenizer has no chat template to render the conversations with")
    return "".join(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=add_generation_prompt) for p in prompts)
