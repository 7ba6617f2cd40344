"""Turns a stream of token ids into text deltas: incremental detokenization that never emits half a
character, and stop strings that end the stream without ever emitting any part of them."""


class TextStream:
    def __init__(self, tokenizer, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._hold_back = max((len(s) for s in stop), default=1) - 1
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""
        self._emitted = 0
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
        decode = self._tokenizer.decode
        before = decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        after = decode(ids[self._prefix_offset :], skip_special_tokens=True)
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
        return delta
