"""Turns a stream of token ids into text deltas: incremental detokenization that never emits half a
character, and stop strings that end the stream without ever emitting any part of them.

Each new token decodes with a window of the tokens before it (vLLM's way): the text of `ids[prefix:]`
past that of `ids[prefix:read]`, where `read` is where the text emitted so far ends and `prefix` where
the window before it starts, so a token costs two decodes of a few tokens, however long the output. The
decodes go straight to the `tokenizers` backend where the transformers tokenizer adds nothing to it
(`plain_decoder`): its wrapper cost three times the decode itself.
"""

from collections.abc import Callable
from functools import partial
from typing import cast

from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from gateway.types import Tokenizer


def plain_decoder(tokenizer: Tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, from the backend when that is all the tokenizer
    does: a TokenizersBackend that overrides neither decode nor _decode, and whose _decode would not clean
    up spaces (transformers skips the clean-up for BPE models unless forced)."""
    kind = type(tokenizer)
    plain = (
        isinstance(tokenizer, TokenizersBackend)
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is TokenizersBackend._decode
        and not _cleans_up_spaces(tokenizer)
    )
    if plain:
        return partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=True)
    # decode's annotation covers a batch of sequences too (list[str]); one sequence of ids decodes to a str
    return cast(Callable[[list[int]], str], partial(tokenizer.decode, skip_special_tokens=True))


def _cleans_up_spaces(tokenizer: Tokenizer) -> bool:
    if not tokenizer.clean_up_tokenization_spaces:
        return False
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return type(tokenizer.backend_tokenizer.model).__name__ != "BPE" or bool(forced)


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self._decode = plain_decoder(tokenizer)
        self._stop = stop
        self._hold_back = max((len(s) for s in stop), default=1) - 1
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # the text not sent yet, after the last `_hold_back` characters sent
        self._emitted = 0  # where in `_text` the text not sent yet starts
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Adds a token; returns the text that is now safe to send. After a stop string was found,
        `stopped` is true and no further text comes."""
        if self.stopped:
            return ""
        self._token_ids.append(token_id)
        self._text += self._decode_new()
        stop_at = self._find_stop()
        if stop_at is not None:
            self.stopped = True
            return self._emit_until(stop_at)
        return self._emit_until(len(self._text) - self._hold_back)

    def flush(self) -> str:
        """The held-back text, once the stream has ended for another reason than a stop string. An
        incomplete character at the very end is decoded as the tokenizer does (a replacement character)."""
        if self.stopped:
            return ""
        self._text += self._decode_new(final=True)
        return self._emit_until(len(self._text))

    def _decode_new(self, final: bool = False) -> str:
        ids = self._token_ids
        before = self._decode(ids[self._prefix_offset : self._read_offset])
        after = self._decode(ids[self._prefix_offset :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return after[len(before) :]

    def _find_stop(self) -> int | None:
        if not self._stop:
            return None
        search_from = max(0, self._emitted - self._hold_back)
        found = [i for i in (self._text.find(s, search_from) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _emit_until(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self._text[self._emitted : end]
        self._emitted = end
        keep_from = end - self._hold_back  # what a stop string could still start in
        if keep_from > 0:  # the rest went out: keep the text short, so that adding to it costs little
            self._text = self._text[keep_from:]
            self._emitted -= keep_from
        return delta
