"""Incremental detokenization and stop strings, on the built-in tokenizer; decoding as the tokenizer does."""

import random

import pytest
from tokenizers import Tokenizer, decoders
from tokenizers.models import WordPiece
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from diptych_common.builtin import DIPTYCH_TINY
from gateway.core.text import TextStream, plain_decoder

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
    deltas, _stream = stream_text(tokenizer, ids, stop=["café", "cache"])
    assert "".join(deltas) == TEXT[: TEXT.index("cache")]


def test_special_tokens_add_no_text(tokenizer):
    ids = tokenizer("hello", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    deltas, stream = stream_text(tokenizer, ids, stop=[])
    assert "".join(deltas) + stream.flush() == "hello"


def test_the_plain_decoder_decodes_as_the_tokenizer_does(tokenizer):
    """Straight from the backend for the built-in (byte-level BPE) tokenizer, equal to its decode on any
    ids: special tokens, single bytes of a character, runs of them."""
    decode = plain_decoder(tokenizer)
    assert decode.func == tokenizer.backend_tokenizer.decode  # the wrapper is skipped
    rng = random.Random(3)
    special = tokenizer.all_special_ids
    samples = [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))] for _ in range(300)]
    samples += [[special[0], 5, special[-1]], tokenizer(TEXT, add_special_tokens=False)["input_ids"]]
    for ids in samples:
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_a_tokenizer_whose_decode_cleans_up_spaces_is_decoded_by_its_own_decode():
    """A WordPiece tokenizer with clean_up_tokenization_spaces: transformers' decode removes the space
    before punctuation, which the backend's does not; the plain decoder keeps transformers' result."""
    backend = Tokenizer(WordPiece({"[UNK]": 0, "hello": 1, ",": 2, "world": 3, "!": 4}, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece(cleanup=False)  # the clean-up is left to transformers
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=True)
    ids = [1, 2, 3, 4]
    assert backend.decode(ids) != tokenizer.decode(ids, skip_special_tokens=True)  # the clean-up matters
    assert plain_decoder(tokenizer)(ids) == tokenizer.decode(ids, skip_special_tokens=True) == "hello, world!"


def test_a_long_output_streams_whole_with_a_stop_string_found_at_its_end(tokenizer):
    """The text kept for stop strings is only the tail that may still hold one: thousands of tokens
    stream as one text, and a stop string split across tokens far into it still ends it."""
    text = " ".join(f"{TEXT} {i}" for i in range(80))
    ids = tokenizer(text + " STOP here", add_special_tokens=False)["input_ids"]
    deltas, stream = stream_text(tokenizer, ids, stop=["STOP", "never-there"])
    assert len(ids) > 2000 and stream.stopped
    assert "".join(deltas) == text + " "
