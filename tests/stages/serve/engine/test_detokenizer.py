"""Incremental detokenisation (never a split character) and stop strings."""
import pytest

from llmopt.stages.serve.engine.config import SamplingParams
from llmopt.stages.serve.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer, OutputText, StopStrings
from tests.helpers import make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def stream(tok, text: str, prompt: str = "the quick") -> list[str]:
    detok = IncrementalDetokenizer(tok, tok.encode(prompt))
    deltas = [detok.add(t) for t in tok.encode(text)]
    return deltas + [detok.flush()]


@pytest.mark.parametrize("text", ["a 😀 fox", "the lazy dog 🦊🐶!", "größe ∑ 漢字 done", "🙂"])
def test_multibyte_characters_are_never_split(tok, text):
    ids = tok.encode(text)
    assert any(REPLACEMENT in tok.decode(ids[:i]) for i in range(len(ids))) or text.isascii()  # the trap is real
    deltas = stream(tok, text)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == text


def test_text_arrives_as_soon_as_a_character_completes(tok):
    prompt, ids = tok.encode("the quick"), tok.encode("fox 😀 dog 🦊")
    deltas = stream(tok, "fox 😀 dog 🦊")
    for i in range(len(ids)):
        decodable = tok.decode(prompt + ids[:i + 1])[len(tok.decode(prompt)):].rstrip(REPLACEMENT)
        assert "".join(deltas[:i + 1]) == decodable


def test_incomplete_bytes_at_the_end_are_flushed_as_decoded(tok):
    detok = IncrementalDetokenizer(tok, [])
    first_byte = tok.encode("😀")[0]
    assert detok.add(first_byte) == ""
    assert detok.flush() == REPLACEMENT


def test_stop_string_cuts_the_text_before_it():
    stop = StopStrings(("STOP",))
    assert [stop.feed(d) for d in ["hello S", "TO", "P and more"]] == ["hello ", "", ""]
    assert stop.stopped and stop.text == "hello "
    assert stop.feed("later") == "" and stop.flush() == ""


def test_a_possible_start_of_a_stop_string_is_held_then_released():
    stop = StopStrings(("STOP",))
    assert stop.feed("ab ST") == "ab "
    assert stop.feed("x") == "STx"
    assert not stop.stopped


def test_earliest_of_several_stop_strings_wins():
    stop = StopStrings(("world", "lo w"))
    assert stop.feed("hello world") == "hel"
    assert stop.stopped


def test_stop_string_inside_one_delta():
    stop = StopStrings(("\n\n",))
    assert stop.feed("line one\n\nline two") == "line one"


def test_output_text_releases_held_text_at_the_end(tok):
    text = OutputText(tok, tok.encode("the"), SamplingParams(stop=("dog house",)))
    deltas = [text.add(t) for t in tok.encode(" lazy dog")]
    assert "".join(deltas) == " lazy "  # "dog" could start "dog house": held
    assert text.finish() == "dog"
    assert text.text == " lazy dog" and not text.stopped


def test_output_text_stops_on_a_stop_string(tok):
    text = OutputText(tok, tok.encode("the"), SamplingParams(stop=("fox",)))
    out = "".join(text.add(t) for t in tok.encode(" quick brown fox jumps"))
    assert text.stopped and out == " quick brown " and text.text == out
    assert text.finish() == ""
