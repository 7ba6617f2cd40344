"""One request's place in its grammar."""

from llguidance import LLMatcher


class GrammarState:
    """Follows a request's output tokens through its grammar; the engine asks it for the next token's
    mask and tells it each token emitted."""

    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher

    def advance(self, token_id: int) -> None:
        """Consumes an emitted token. Raises GrammarViolation when the grammar forbids it."""
        if not self.matcher.consume_token(token_id):
            raise GrammarViolation(f"its token {token_id} does not follow its grammar: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar takes no further token: the request is done."""
        return self.matcher.is_stopped()


class GrammarViolation(Exception):
    """A token the request's grammar forbids (tokens sent with it, or a defect of the mask)."""
