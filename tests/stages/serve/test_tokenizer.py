"""The serving tokenizer (stages/serve/tokenizer.py) answers as transformers' tokenizer does for the same
files: encode, decode, the chat template, the special tokens; and it falls back to transformers where the
files ask for more. The same comparison on SmolLM2's tokenizer is in tests/integration/test_smollm2_tokenizer.py."""
import copy
import json

import pytest
from transformers import AutoTokenizer

from llmopt.stages.serve.tokenizer import ServeTokenizer, load_serve_tokenizer
from tests.helpers import write_chat_model_dir

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<eos>system\nYou are helpful.\n' }}{% endif %}{{ '<eos>' + message['role'] + '\n' + message['content'] "
          "+ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<eos>assistant\n' }}{% endif %}")
TEXTS = ["", "the quick brown fox", "  leading and trailing  ", "tabs\tand\nnewlines\r\n", "émoji 🤖 and ünïcode",
         "special <eos> inside", "numbers 1234567 and code: def f(x): return x ** 2", "repeat " * 40,
         "don't stop , isn't it ? yes !"]
CONVERSATIONS = [[{"role": "user", "content": "hello"}],
                 [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"},
                  {"role": "assistant", "content": "because"}, {"role": "user", "content": "ok <eos> 🤖"}]]


def check_equivalent(ours, theirs, texts=TEXTS, conversations=CONVERSATIONS) -> None:
    """Every answer serving asks of a tokenizer is the same from both."""
    assert ours.eos_token_id == theirs.eos_token_id and ours.pad_token_id == theirs.pad_token_id
    assert ours.chat_template == theirs.chat_template
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)
        ids = theirs.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
            for i in range(len(ids)):  # one token at a time, as the detokenizer asks (half characters too)
                assert ours.decode(ids[i:i + 1], skip_special_tokens=skip) == \
                    theirs.decode(ids[i:i + 1], skip_special_tokens=skip)
    for messages in conversations:
        for prompt in (True, False):
            kwargs = dict(tokenize=False, add_generation_prompt=prompt)
            assert ours.apply_chat_template(messages, **kwargs) == theirs.apply_chat_template(messages, **kwargs)
            kwargs = dict(tokenize=True, add_generation_prompt=prompt, return_dict=False)
            assert ours.apply_chat_template(messages, **kwargs) == theirs.apply_chat_template(messages, **kwargs)
            tokens = theirs.apply_chat_template(messages, add_generation_prompt=prompt)
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == \
                {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return write_chat_model_dir(tmp_path_factory.mktemp("tok"), CHATML)


def test_the_tiny_tokenizer_answers_as_transformers(chat_dir):
    ours = load_serve_tokenizer(chat_dir)
    assert isinstance(ours, ServeTokenizer)
    check_equivalent(ours, AutoTokenizer.from_pretrained(chat_dir))


def test_copies_share_the_immutable_tokenizer(chat_dir):
    ours = load_serve_tokenizer(chat_dir)
    assert copy.deepcopy(ours) is ours


@pytest.mark.parametrize("change", ["add_bos_token", "clean_up_tokenization_spaces", "no_tokenizer_json",
                                    "generation_tag"])
def test_files_that_ask_for_more_get_transformers(chat_dir, tmp_path, change):
    for name in ("tokenizer.json", "chat_template.jinja", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((chat_dir / name).read_bytes())
    if change in ("add_bos_token", "clean_up_tokenization_spaces"):  # transformers edits what the Rust side does
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, change: True}))
    elif change == "no_tokenizer_json":  # a slow-only tokenizer: transformers' business
        (tmp_path / "tokenizer.json").unlink()
        pytest.importorskip("sentencepiece")
        return
    else:
        (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{% generation %}{{ m['content'] }}"
                                                      "{% endgeneration %}{% endfor %}")
    tok = load_serve_tokenizer(tmp_path)
    assert not isinstance(tok, ServeTokenizer)
    assert tok.encode("the fox") == AutoTokenizer.from_pretrained(tmp_path).encode("the fox")


def test_no_chat_template_is_said(tmp_path):
    from tests.helpers import write_hf_dir

    write_hf_dir(tmp_path)
    ours = load_serve_tokenizer(tmp_path)
    assert isinstance(ours, ServeTokenizer) and not ours.chat_template
    with pytest.raises(ValueError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
