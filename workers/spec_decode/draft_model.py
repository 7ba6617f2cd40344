"""Drafting with a second, smaller causal LM of the target's vocabulary, run greedily over the request's
tokens.

The draft model runs unpaged through its own `transformers` forward, one request at a time, each with its
own small KV cache: a request's cache is cut back to the tokens it shares with the request's tokens now
(the accepted ones stay, rejected drafts go) and only the rest is fed. A request not drafting in a step
loses its cache (it is rebuilt from its tokens if it drafts again), so caches never outlive requests.
"""

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from workers.spec_decode.proposer import DraftRequest


@dataclass
class _DraftState:
    token_ids: list[int] = field(default_factory=list)  # the tokens whose keys and values `cache` holds
    cache: DynamicCache = field(default_factory=DynamicCache)


class DraftModelProposer:
    def __init__(self, model: PreTrainedModel, target_vocab_size: int) -> None:
        draft_vocab_size = model.config.vocab_size
        if draft_vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary has {draft_vocab_size} tokens, the served model's "
                f"{target_vocab_size}: a draft model must share the served model's tokenizer"
            )
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.max_positions: int = model.config.max_position_embeddings
        self._states: dict[str, _DraftState] = {}

    @classmethod
    def load(cls, source: str, target_vocab_size: int, device: str) -> "DraftModelProposer":
        """Loads the draft model from `source` (builtin:<name> or a model directory) onto `device`."""
        from workers.model_loader import load_model

        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        loaded = load_model(f"draft model {source}", source, dtype=dtype)
        return cls(loaded.model.to(device), target_vocab_size)  # type: ignore[arg-type]

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        states: dict[str, _DraftState] = {}
        proposals = []
        for request in requests:
            state = self._states.get(request.request_id) or _DraftState()
            states[request.request_id] = state
            proposals.append(self._propose_one(state, request.token_ids, request.max_drafts))
        self._states = states
        return proposals

    def _propose_one(self, state: _DraftState, token_ids: list[int], count: int) -> list[int]:
        count = min(count, self.max_positions - len(token_ids))
        if count < 1 or not token_ids:
            return []
        kept = _shared_prefix(state.token_ids, token_ids, len(token_ids) - 1)  # at least one token to feed
        if kept < len(state.token_ids):
            state.cache.crop(kept - len(state.token_ids))
            del state.token_ids[kept:]
        feed = token_ids[kept:]
        drafts: list[int] = []
        while True:
            logits = self._forward(state, feed)
            drafts.append(int(torch.nan_to_num(logits, nan=-torch.inf).argmax()))
            if len(drafts) == count:
                return drafts
            feed = drafts[-1:]

    def _forward(self, state: _DraftState, feed: list[int]) -> torch.Tensor:
        """Feeds `feed` after the cached tokens; returns the logits [vocab] of the last one."""
        ids = torch.tensor([feed], dtype=torch.long, device=self.device)
        output = self.model(input_ids=ids, past_key_values=state.cache, use_cache=True, logits_to_keep=1)
        state.token_ids.extend(feed)
        return output.logits[0, -1].float()


def _shared_prefix(first: list[int], second: list[int], limit: int) -> int:
    length = 0
    for a, b in zip(first[:limit], second[:limit], strict=False):
        if a != b:
            break
        length += 1
    return length
