"""Grammars of structured outputs, shared by the gateway (which checks a request's grammar before it runs)
and the workers (which make every output token follow it): a `Grammar` as llguidance grammar text, and a
model's tokenizer as llguidance's."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance.hf
from llguidance import LLMatcher, LLTokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_SCHEMA, JSON_OBJECT, LARK_GRAMMAR = "json_schema", "json_object", "lark_grammar"  # worker.proto's Constraint
# JSON is produced compact, with one space after ',' and ':': whitespace is never the model's choice, so a
# model cannot spend its max_tokens on it.
JSON_OPTIONS: "JsonCompileOptions" = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    kind: str  # JSON_SCHEMA, JSON_OBJECT or LARK_GRAMMAR
    text: str = ""  # the schema's JSON text, or the Lark grammar; empty for JSON_OBJECT


def llguidance_grammar(grammar: Grammar) -> str:
    """The grammar as llguidance compiles it. Raises ValueError when a schema is not a JSON object."""
    if grammar.kind == JSON_OBJECT:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if grammar.kind == JSON_SCHEMA:
        return LLMatcher.grammar_from_json_schema(grammar.text, overrides=JSON_OPTIONS)
    if grammar.kind == LARK_GRAMMAR:
        return LLMatcher.grammar_from_lark(grammar.text)
    raise ValueError(f"unknown grammar kind {grammar.kind!r}")


def grammar_error(grammar: Grammar, tokenizer: LLTokenizer) -> str | None:
    """Why the grammar cannot be followed (an invalid schema, a keyword not supported), or None."""
    try:
        compiled = llguidance_grammar(grammar)
    except ValueError as error:
        return f"it is not valid JSON: {error}"
    is_error, messages = LLMatcher.validate_grammar_with_warnings(compiled, tokenizer)
    return messages[0] if is_error else None


def llguidance_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer over a model's `vocab_size` logits (about a
    second for a large vocabulary: build it once). `eos_token_ids`: the tokens that end a sequence (empty:
    the tokenizer's own)."""
    eos = sorted(eos_token_ids) or hf_tokenizer.eos_token_id
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
