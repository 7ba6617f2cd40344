"""What the engine asks of a proposer, and the proposer a SpecConfig names."""

from dataclasses import dataclass
from typing import Protocol

from workers.spec_decode.config import SpecConfig


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


def build_proposer(spec: SpecConfig, vocab_size: int, device: str) -> Proposer:
    """The proposer `spec` names, for a target model of `vocab_size` tokens; a draft model is loaded here."""
    if spec.method == "ngram":
        from workers.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.ngram_min, spec.ngram_max)
    from workers.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer.load(spec.draft_model, vocab_size, device)
