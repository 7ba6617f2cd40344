"""The proposer a SpecConfig names."""

from workers.spec_decode.config import SpecConfig
from workers.spec_decode.draft_model import DraftModelProposer
from workers.spec_decode.ngram import NgramProposer
from workers.spec_decode.proposer import NewDraftBlocks, Proposer


def build_proposer(spec: SpecConfig, vocab_size: int, device: str, new_blocks: NewDraftBlocks) -> Proposer:
    """The proposer `spec` names, for a target model of `vocab_size` tokens; a draft model is loaded here,
    its pool's block tables made by `new_blocks`."""
    if spec.method == "ngram":
        return NgramProposer(spec.ngram_min, spec.ngram_max)
    return DraftModelProposer.load(spec.draft_model, vocab_size, new_blocks, device)
