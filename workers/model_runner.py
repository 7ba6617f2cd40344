"""Runs the model's forward passes: batched prefill and one batched decode step."""

import torch

from workers.kv_cache import DecodeBatch, SequenceKV
from workers.model_loader import LoadedModel


class ModelRunner:
    def __init__(self, loaded: LoadedModel) -> None:
        self.model = loaded.model
        self.config = loaded.model.config
        self.pad_token_id = self.config.pad_token_id or 0

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, list[SequenceKV]]:
        """Runs the prompts right-padded in one pass; causal attention keeps the padding out of every
        real position, so no attention mask is needed. Returns the last position's logits per prompt,
        shaped [batch, vocab], and each prompt's KV."""
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        out = self.model(input_ids=input_ids, use_cache=True)
        last = torch.tensor([len(p) - 1 for p in prompts])
        logits = out.logits[torch.arange(len(prompts)), last].float()
        kvs = [
            SequenceKV(
                [(layer.keys[row, :, : len(prompt)].clone(), layer.values[row, :, : len(prompt)].clone())
                 for layer in out.past_key_values.layers]
            )
            for row, prompt in enumerate(prompts)
        ]
        return logits, kvs

    @torch.inference_mode()
    def decode_step(self, batch: DecodeBatch, input_token_ids: list[int]) -> torch.Tensor:
        """Feeds one token per running sequence; returns next-token logits shaped [batch, vocab]."""
        input_ids = torch.tensor(input_token_ids, dtype=torch.long).unsqueeze(1)
        position_ids = torch.tensor(batch.lengths, dtype=torch.long).unsqueeze(1)
        batch.advance()
        out = self.model(
            input_ids=input_ids,
            attention_mask=batch.attention_mask,
            position_ids=position_ids,
            past_key_values=batch.cache,
            use_cache=True,
        )
        return out.logits[:, -1].float()
