"""What one engine step computes, as the scheduler decides it: each request's chunk of tokens, the requests
whose first tokens' KV a connector loads, those preempted, and the step's KV hand-off."""

from dataclasses import dataclass, field

from workers.engine.kv_transfer import EMPTY_META, KvConnectorMeta
from workers.engine.request import EngineRequest


@dataclass
class ScheduledChunk:
    request: EngineRequest
    start: int  # position of the first token computed this step
    num_tokens: int  # the drafts included
    # a decoding request's drafts, computed after its last token to be verified (speculative decoding)
    draft_token_ids: list[int] = field(default_factory=list)
    # whether this chunk reaches the request's last token (its placeholder included), whose logits give
    # the next token: fixed when the chunk is made, as the request's counts move on once its step runs
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        end = self.start + self.num_tokens - len(self.draft_token_ids)
        self.samples = end == self.request.num_tokens_with_placeholders


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    loads: list[EngineRequest] = field(default_factory=list)  # admitted with KV the connector loads
    preempted: list[EngineRequest] = field(default_factory=list)
    kv_connector_meta: KvConnectorMeta = EMPTY_META  # the connector's, set when there are chunks to compute

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)
