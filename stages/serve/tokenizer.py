"""The serving tokenizer: a model directory's `tokenizer.json` through the `tokenizers` library, without
importing transformers (2-3 s of CPU at start-up here, for a tokenizer that loads in 0.1 s).

`ServeTokenizer` answers what serving asks of a tokenizer (encode, decode, the chat template, the special
tokens) exactly as transformers' fast tokenizer does for the same files: the same Rust tokenizer, and the
chat template rendered in a sandbox set up as transformers sets up its own (trim_blocks, lstrip_blocks,
loop controls, its `tojson`, `raise_exception`, `strftime_now`), with the special tokens as template
variables. tests/stages/serve/test_tokenizer.py checks the equivalence.
A directory this does not cover (no tokenizer.json, a tokenizer_config that asks transformers to add
tokens or change the post-processor, a template using transformers' `{% generation %}` tag) gets
transformers' tokenizer (`model_io.load_tokenizer`).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from ..errors import SourceError

# tokenizer_config keys that make transformers change what the Rust tokenizer does: such a directory goes
# through transformers.
_TRANSFORMERS_ONLY = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy", "from_slow",
                      "spaces_between_special_tokens", "clean_up_tokenization_spaces")
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_serve_tokenizer(directory: Path):
    """A ServeTokenizer for the directory when its files allow one, else transformers' tokenizer."""
    directory = Path(directory)
    config = _read_json(directory / "tokenizer_config.json")
    if not (directory / "tokenizer.json").is_file() or config is None \
            or any(config.get(k) not in (None, False) for k in _TRANSFORMERS_ONLY) \
            or config.get("tokenizer_class") not in ("TokenizersBackend", "PreTrainedTokenizerFast", "GPT2Tokenizer",
                                                     "GPT2TokenizerFast", None):
        from ..model_io import load_tokenizer

        return load_tokenizer(directory)
    import tokenizers

    try:
        rust = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception as e:  # the Rust side raises plain Exceptions for a malformed file
        raise SourceError(f"{directory}/tokenizer.json: cannot be loaded ({str(e).splitlines()[0]})") from None
    template = config.get("chat_template")
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    if template is not None and not isinstance(template, str):  # a list of named templates: transformers' job
        from ..model_io import load_tokenizer

        return load_tokenizer(directory)
    tokenizer = ServeTokenizer(rust, config, template)
    if template:
        import jinja2

        try:
            tokenizer._template = compile_chat_template(template)
        except jinja2.TemplateSyntaxError:  # a tag of transformers' own ({% generation %}): its renderer
            from ..model_io import load_tokenizer

            return load_tokenizer(directory)
    return tokenizer


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _token_text(value) -> str | None:
    """A special token as tokenizer_config writes it: a string, or an AddedToken dict with its content."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class ServeTokenizer:
    """encode / decode / apply_chat_template over a `tokenizers.Tokenizer` (see the module docstring). The
    Rust tokenizer is never reconfigured (no padding or truncation), so copies share it."""

    def __init__(self, tokenizer, config: dict, chat_template: str | None):
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens_map = {k: t for k in _SPECIAL if (t := _token_text(config.get(k))) is not None}
        for name in _SPECIAL:
            token = self.special_tokens_map.get(name)
            setattr(self, f"{name}_id", None if token is None else tokenizer.token_to_id(token))
        self._template = None

    def __deepcopy__(self, memo) -> "ServeTokenizer":
        return self  # immutable: the engine's thread and the server's may share it

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        """Every token (added ones included) -> its id, as transformers' `get_vocab`."""
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids) -> list[str | None]:
        """Each id's token as the vocabulary spells it ("Ġthe"), as transformers' method of this name."""
        return [self._tokenizer.id_to_token(i) for i in token_ids]

    def apply_chat_template(self, messages: list[dict], tokenize: bool = True, add_generation_prompt: bool = False,
                            return_dict: bool = True, **kwargs):
        """The conversation rendered with the chat template; with tokenize=True its token ids, as transformers
        returns them ({"input_ids", "attention_mask"}, or the list with return_dict=False)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = self._compiled().render(messages=messages, tools=None, documents=None,
                                       add_generation_prompt=add_generation_prompt,
                                       **{**self.special_tokens_map, **kwargs})
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    def _compiled(self):
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        return self._template


def compile_chat_template(source: str):
    """A jinja2 template in a sandbox set up as transformers sets up its own for chat templates."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)

