"""A request as the engine tracks it: its tokens, how many of them have KV computed, its status."""

import enum
from dataclasses import dataclass, field

from workers.engine.kv_transfer import KvTransferParams
from workers.engine.sampling import SamplingParams
from workers.structured.state import GrammarState

INTERACTIVE, BATCH = 0, 1  # priorities, as in worker.proto; lower is served first


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class RequestFailed(Exception):
    """One request failed in a step its batch-mates survived (its sampling raised, or its logits were
    not finite); the message starts "the request failed on this worker: "."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the request failed on this worker: {reason}")


class FinishReason(enum.Enum):
    STOPPED = "stopped"  # a stop condition: end of sequence, max tokens, context length
    HANDED_OFF = "handed_off"  # a prefill-only request produced its first token; decode goes on elsewhere
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = INTERACTIVE
    prefill_only: bool = False  # stops after the first token (a prefill worker's job)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit when first scheduled
    arrival: int = 0
    queued_ns: int = 0  # wall clock (time.time_ns) when queued here, and when first scheduled: its trace spans
    scheduled_ns: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    kv_transfer: KvTransferParams | None = None  # its part in a KV hand-off between workers
    num_preemptions: int = 0
    aborted: bool = False
    cache_salt: str = ""  # its organization: prefix-cache blocks are named, and shared, under it
    # speculative decoding: tokens guessed to follow its tokens, proposed at the end of its last step and
    # verified in its next decoding step (replaced whenever its tokens change)
    draft_token_ids: list[int] = field(default_factory=list)
    # structured outputs: its place in the grammar its output follows (None: free text)
    constraint: GrammarState | None = None
    # asynchronous scheduling: tokens that launched steps sample for it and the host has not seen yet (one
    # per such step); the scheduler counts them among its tokens, and the next step's input holds a
    # placeholder for the last, which the forward thread fills with the pick
    num_output_placeholders: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Its tokens at positions start..end-1 (as far as it has them), without joining prompt and output."""
        prompt = len(self.prompt_token_ids)
        if start >= prompt:
            return self.output_token_ids[start - prompt : end - prompt]
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt]

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_tokens + self.num_output_placeholders

    @property
    def prompt_tokens_pending(self) -> int:
        """Prompt tokens whose KV is still to be computed here: none while it comes from another worker
        (once preempted, the request recomputes its whole prompt)."""
        if self.kv_transfer is not None and self.kv_transfer.load_tokens and self.num_preemptions == 0:
            return 0
        return max(0, len(self.prompt_token_ids) - self.num_computed_tokens)

    @property
    def generated_token_ids(self) -> list[int]:
        """Its output so far, the tokens produced before a migration (the last `tokens_already_generated`
        of its prompt) included: what penalties count."""
        already = self.sampling.tokens_already_generated
        earlier = self.prompt_token_ids[len(self.prompt_token_ids) - already :] if already else []
        return earlier + self.output_token_ids

    @property
    def sample_index(self) -> int:
        """The index, in the whole request, of the token sampled next (seeded sampling draws by it)."""
        return self.sampling.tokens_already_generated + len(self.output_token_ids)
