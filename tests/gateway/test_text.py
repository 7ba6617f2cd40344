"""Incremental detokenization and stop strings, on the built-in tokenizer."""

import pytest
from transformers import AutoTokenizer

from diptych_common.builtin import DIPTYCH_TINY
from gateway.core.text import TextStream

TEXT = "Prefill → decode: the cache moves — 日本語 too, émigré café! 🚀 done."


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DIPTYCH_TINY.tokenizer_dir)


def stream_text(tokenizer, ids, stop):
    stream = TextStream(tokenizer, stop)
    deltas = [stream.push(token) for token in ids]
    return deltas, stream


def test_deltas_add_up_to_the_text_and_never_split_a_character(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    deltas, stream = stream_text(tokenizer, ids, stop=[])
    deltas.append(stream.flush())
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("stop", ["cache", "日本", "🚀", "!"])
def test_a_stop_string_ends_the_text_before_it_and_never_leaks(tokenizer, stop):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    deltas, stream = stream_text(tokenizer, ids, stop=[stop, "never-there"])
    assert stream.stopped
    assert "".join(deltas) + stream.flush() == TEXT[: TEXT.index(stop)]


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    deltas, stream = stream_text(tokenizer, ids, stop=["café", "cache"])
    assert "".join(deltas) == TEXT[: TEXT.index("cache")]


def test_special_tokens_add_no_text(tokenizer):
    ids = tokenizer("hello", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    deltas, stream = stream_text(tokenizer, ids, stop=[])
    assert "".join(deltas) + stream.flush() == "hello"
