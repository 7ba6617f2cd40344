"""What the engine asks of a proposer."""

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class DraftRequest:
    """One decoding request to draft for: all its tokens (prompt and output so far) and how many drafts
    are worth proposing (fewer near max_tokens or the context length)."""

    request_id: str
    token_ids: list[int]
    max_drafts: int


class Proposer(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Per request, in order, up to `max_drafts` tokens guessed to follow its tokens (maybe none).
        Called once per step with every request that drafts in it, on the engine's forward thread."""
        ...
