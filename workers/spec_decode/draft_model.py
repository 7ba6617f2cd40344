"""Drafting with a second, smaller causal LM of the target's vocabulary, run greedily over the request's
tokens.

The draft model runs on a `ModelRunner` of its own, over a paged KV pool of its own, batched: one step
catches every drafting request up on the tokens it has not seen (its accepted drafts and the target's
pick; a rejected draft's slot is simply computed again) and picks each one's first draft, then one
single-token step per further draft extends all the requests that still want one. A request keeps its
blocks while it drafts step after step; one that does not draft in a step gives them back (its KV is
rebuilt from its tokens if it drafts again), so the pool never holds a request that left. A request the
pool has no room for gets no drafts.
"""

import torch
from transformers import PreTrainedModel

from workers.models.step import StepInput
from workers.runner.kv_pool import kv_layout_of
from workers.runner.model_runner import ModelRunner
from workers.spec_decode.proposer import DraftRequest, NewDraftBlocks

BLOCK_SIZE = 16
DEFAULT_KV_CACHE_MIB = 128


class DraftModelProposer:
    def __init__(
        self,
        model: PreTrainedModel,
        target_vocab_size: int,
        new_blocks: NewDraftBlocks,
        device: str = "cpu",
        kv_cache_mib: int = DEFAULT_KV_CACHE_MIB,
    ) -> None:
        draft_vocab_size = model.config.vocab_size
        if draft_vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary has {draft_vocab_size} tokens, the served model's "
                f"{target_vocab_size}: a draft model must share the served model's tokenizer"
            )
        layout = kv_layout_of(model.config, BLOCK_SIZE, next(model.parameters()).dtype)
        num_blocks = max(1, (kv_cache_mib << 20) // layout.block_nbytes)
        self.runner = ModelRunner(model.eval(), num_blocks, BLOCK_SIZE, device)
        self.kv = new_blocks(num_blocks, BLOCK_SIZE)
        self.max_positions: int = model.config.max_position_embeddings
        self._computed: dict[str, list[int]] = {}  # per request, the tokens whose KV its blocks hold

    @classmethod
    def load(cls, source: str, target_vocab_size: int, new_blocks: NewDraftBlocks, device: str) -> "DraftModelProposer":
        """Loads the draft model from `source` (builtin:<name> or a model directory) onto `device`."""
        from workers.runner.model_loader import load_model

        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        loaded = load_model(f"draft model {source}", source, dtype=dtype)
        return cls(loaded.model.to(device), target_vocab_size, new_blocks, device)  # type: ignore[arg-type]

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        wanted = {request.request_id for request in requests}
        for request_id in [r for r in self._computed if r not in wanted]:
            self._drop(request_id)
        counts = [self._room(request) for request in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        inputs = [self._catch_up(request) for request, count in zip(requests, counts, strict=True) if count]
        drafting = [index for index, count in enumerate(counts) if count]
        while drafting:
            for index, token_id in zip(drafting, self._greedy(inputs), strict=True):
                drafts[index].append(token_id)
            drafting = [index for index in drafting if len(drafts[index]) < counts[index]]
            inputs = [self._extend(requests[index].request_id, drafts[index][-1]) for index in drafting]
        return drafts

    def _room(self, request: DraftRequest) -> int:
        """How many drafts the request gets: its ask, within the draft model's context and the pool (its
        drafts' KV but the last one's is computed); 0, with its blocks given back, when none fit."""
        count = min(request.max_drafts, self.max_positions - len(request.token_ids))
        if count < 1 or not self.kv.allocate(request.request_id, len(request.token_ids) + count - 1):
            self._drop(request.request_id)
            return 0
        return count

    def _catch_up(self, request: DraftRequest) -> StepInput:
        """The request's tokens after those its blocks hold with the same ids (at least its last token)."""
        held = self._computed.setdefault(request.request_id, [])
        token_ids = request.token_ids
        kept = 0
        while kept < min(len(held), len(token_ids) - 1) and held[kept] == token_ids[kept]:
            kept += 1
        held[kept:] = token_ids[kept:]
        return StepInput(token_ids[kept:], kept, self.kv.block_ids(request.request_id), sample=True)

    def _extend(self, request_id: str, token_id: int) -> StepInput:
        held = self._computed[request_id]
        held.append(token_id)
        return StepInput([token_id], len(held) - 1, self.kv.block_ids(request_id), sample=True)

    def _greedy(self, inputs: list[StepInput]) -> list[int]:
        logits = self.runner.execute(inputs)
        return torch.nan_to_num(logits, nan=-torch.inf).argmax(dim=-1).tolist()

    def _drop(self, request_id: str) -> None:
        self._computed.pop(request_id, None)
        self.kv.free(request_id)
