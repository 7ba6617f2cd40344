"""Compiles grammars for one model's tokenizer, keeping the most recently used ones: a request whose
grammar was seen before starts from a copy of its compiled matcher."""

import threading
from collections import OrderedDict

from llguidance import LLMatcher, LLTokenizer

from diptych_common.grammar import Grammar, llguidance_grammar
from workers.structured.state import GrammarState, GrammarViolation

CACHED_GRAMMARS = 64


class GrammarRejected(Exception):
    """A grammar that cannot be followed; the message says why."""


class GrammarCompiler:
    def __init__(self, tokenizer: LLTokenizer, cache_size: int = CACHED_GRAMMARS) -> None:
        self.tokenizer = tokenizer
        self._cache_size = cache_size
        self._compiled: OrderedDict[Grammar, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # requests start on threads of their own (a large grammar takes a while)

    def start(self, grammar: Grammar, produced: list[int]) -> GrammarState:
        """A request's matcher, past the tokens it already produced (on another worker, or before a
        migration). Raises GrammarRejected for a grammar that does not compile, or tokens it forbids."""
        with self._lock:
            state = GrammarState(self._compiled_matcher(grammar).deep_copy())
        for token_id in produced:
            try:
                state.advance(token_id)
            except GrammarViolation as violation:
                raise GrammarRejected(f"the tokens already produced do not follow the grammar: {violation}") from None
        return state

    def _compiled_matcher(self, grammar: Grammar) -> LLMatcher:
        matcher = self._compiled.get(grammar)
        if matcher is not None:
            self._compiled.move_to_end(grammar)
            return matcher
        try:
            matcher = LLMatcher(self.tokenizer, llguidance_grammar(grammar), log_level=0)
        except ValueError as error:
            raise GrammarRejected(f"the grammar does not compile: {error}") from None
        if matcher.is_error():
            raise GrammarRejected(f"the grammar does not compile: {matcher.get_error()}")
        self._compiled[grammar] = matcher
        if len(self._compiled) > self._cache_size:
            self._compiled.popitem(last=False)
        return matcher

    @property
    def cached(self) -> int:
        return len(self._compiled)
