"""The proposer a SpecConfig names."""

from workers.spec_decode.config import SpecConfig
from workers.spec_decode.draft_model import DraftModelProposer
from workers.spec_decode.ngram import NgramProposer
from workers.spec_decode.proposer import Proposer


def build_proposer(spec: SpecConfig, vocab_size: int, device: str) -> Proposer:
    """The proposer `spec` names, for a target model of `vocab_size` tokens; a draft model is loaded here."""
    if spec.method == "ngram":
        return NgramProposer(spec.ngram_min, spec.ngram_max)
    return DraftModelProposer.load(spec.draft_model, vocab_size, device)
