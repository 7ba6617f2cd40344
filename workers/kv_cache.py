"""KV cache state: one sequence's cache as it travels, and the decode batch's padded cache.

A sequence's KV is a list of (keys, values) per layer, each shaped [kv_heads, seq_len, head_dim].
The decode batch holds the KV of all running sequences left-padded into one DynamicCache, with an
attention mask that hides the padding; it is rebuilt when sequences join or leave.
"""

from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class SequenceKV:
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


class DecodeBatch:
    """The padded KV of the running decode sequences, in a fixed row order."""

    def __init__(self, config) -> None:
        self._config = config
        self.request_ids: list[str] = []
        self.cache: DynamicCache | None = None
        self.attention_mask: torch.Tensor | None = None
        self.lengths: list[int] = []

    def extract(self, request_id: str) -> SequenceKV:
        """The unpadded KV of one row, as a standalone copy."""
        row = self.request_ids.index(request_id)
        start = self.attention_mask.shape[1] - self.lengths[row]
        return SequenceKV(
            [(layer.keys[row, :, start:].clone(), layer.values[row, :, start:].clone()) for layer in self.cache.layers]
        )

    def rebuild(self, members: list[tuple[str, SequenceKV]]) -> None:
        """Packs the given sequences, left-padded to the longest, as the new batch."""
        self.request_ids = [request_id for request_id, _ in members]
        self.lengths = [kv.length for _, kv in members]
        if not members:
            self.cache, self.attention_mask = None, None
            return
        width = max(self.lengths)
        num_layers = len(members[0][1].layers)
        layers = []
        for layer in range(num_layers):
            keys = [kv.layers[layer][0] for _, kv in members]
            values = [kv.layers[layer][1] for _, kv in members]
            layers.append((_left_pad(keys, width), _left_pad(values, width)))
        self.cache = DynamicCache(ddp_cache_data=layers, config=self._config)
        self.attention_mask = torch.zeros(len(members), width, dtype=torch.long)
        for row, length in enumerate(self.lengths):
            self.attention_mask[row, width - length:] = 1

    def advance(self) -> None:
        """Accounts for one decoded token per row (the model appended it to the cache)."""
        ones = torch.ones(len(self.request_ids), 1, dtype=torch.long)
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)
        self.lengths = [length + 1 for length in self.lengths]


def _left_pad(tensors: list[torch.Tensor], width: int) -> torch.Tensor:
    heads, _, head_dim = tensors[0].shape
    out = torch.zeros(len(tensors), heads, width, head_dim, dtype=tensors[0].dtype)
    for row, tensor in enumerate(tensors):
        out[row, :, width - tensor.shape[1]:] = tensor
    return out
