"""What the engine asks of a proposer, and what it lends a draft model (the block tables of its pool)."""

from collections.abc import Callable
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


class DraftBlocks(Protocol):
    """The block tables of a draft model's paged KV pool, per request (the engine's KV cache manager)."""

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grows the request's table to hold `num_tokens`; False, changing nothing, when the pool is full."""
        ...

    def block_ids(self, request_id: str) -> list[int]: ...

    def free(self, request_id: str) -> None: ...


# (num_blocks, block_size) -> the block tables of a new pool: the engine says how a draft pool is kept
NewDraftBlocks = Callable[[int, int], DraftBlocks]
