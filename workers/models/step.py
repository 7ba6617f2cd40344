"""What a step asks of the model for one request: the runner's input, which the attention plans read."""

from dataclasses import dataclass


@dataclass
class StepInput:
    """One request's part of a step: tokens at positions start.. of the request, over its blocks."""

    token_ids: list[int]
    start: int
    block_ids: list[int]
    sample: bool  # whether its last token's logits are wanted
    # speculative decoding: its last tokens are this many drafts, whose positions (and the one before
    # them) all need logits, to verify the drafts and pick the token after them
    num_draft_tokens: int = 0
    # the KV cache manager's own block table of the request (`KVCacheManager.block_tables`): one object for as
    # long as the request holds its blocks, growing only, so a runner that saw it last step writes only the
    # ids added since (`workers.runner.step_buffers`); None: the ids are written whole
    table: object | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.num_draft_tokens < len(self.token_ids):
            raise ValueError(
                f"an input of {len(self.token_ids)} tokens cannot end in {self.num_draft_tokens} drafts: "
                "the token before them is computed with them"
            )

    @property
    def num_logits(self) -> int:
        """How many of its trailing positions get logits."""
        return self.num_draft_tokens + 1 if self.sample else 0
