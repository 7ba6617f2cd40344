"""Output tokens' logprobs as the client gets them: each token with its text (the model's tokenizer decodes
it alone), and OpenAI's shapes of them for chat (`logprobs.content`) and completions (`logprobs.tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`).

A token that holds only part of a character decodes alone to U+FFFD; its `bytes` are then the token's own
bytes where the tokenizer is byte-level (or names a byte, `<0xE2>`), so that a client joining the bytes
of consecutive tokens gets the text back.
"""

import re
from functools import lru_cache
from typing import Any, cast

from gateway.types import Tokenizer, TokenLogprob, TopLogprob, WorkerLogprobs

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_logprob(tokenizer: Tokenizer, token_id: int, worker: WorkerLogprobs) -> TokenLogprob:
    """A worker's logprobs of `token_id`, with the texts of the token and its alternatives."""
    top = tuple(TopLogprob(other, token_text(tokenizer, other), value) for other, value in worker.top)
    return TokenLogprob(token_id, token_text(tokenizer, token_id), worker.logprob, top)


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return cast(str, tokenizer.decode([token_id]))  # one sequence of ids decodes to a str


def token_bytes(tokenizer: Tokenizer, token_id: int, text: str) -> list[int]:
    """The UTF-8 bytes of the token's text; for a token holding part of a character, its own bytes."""
    if "\ufffd" in text:
        raw = _raw_bytes(tokenizer, token_id)
        if raw is not None:
            return list(raw)
    return list(text.encode("utf-8"))


def _raw_bytes(tokenizer: Tokenizer, token_id: int) -> bytes | None:
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return None
    if match := _BYTE_TOKEN.fullmatch(piece):
        return bytes([int(match.group(1), 16)])
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    alphabet = _byte_level_alphabet()
    if not all(char in alphabet for char in piece):
        return None
    return bytes(alphabet[char] for char in piece)


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level tokenizers' characters, each standing for one byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    return {
        "content": [
            {
                **_entry(tokenizer, entry.token_id, entry.token, entry.logprob),
                "top_logprobs": [_entry(tokenizer, top.token_id, top.token, top.logprob) for top in entry.top_logprobs],
            }
            for entry in logprobs
        ]
    }


def _entry(tokenizer: Tokenizer, token_id: int, token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": token_bytes(tokenizer, token_id, token)}


class CompletionLogprobs:
    """A completion choice's `logprobs`, chunk after chunk: `text_offset` counts the characters of the
    tokens before, over the whole output (each token's text as decoded alone)."""

    def __init__(self) -> None:
        self._offset = 0

    def shape(self, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        offsets = []
        for entry in logprobs:
            offsets.append(self._offset)
            self._offset += len(entry.token)
        return {
            "tokens": [entry.token for entry in logprobs],
            "token_logprobs": [entry.logprob for entry in logprobs],
            # the sampled token is always among them, as OpenAI's are
            "top_logprobs": [
                {**{top.token: top.logprob for top in entry.top_logprobs}, entry.token: entry.logprob}
                for entry in logprobs
            ],
            "text_offset": offsets,
        }
