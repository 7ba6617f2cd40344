"""Token masks: a row of logits whose request follows a grammar loses every token the grammar forbids next."""

import math

import llguidance.torch
import torch

from workers.structured.state import GrammarState

_BITS = torch.arange(32, dtype=torch.int32)


def apply_grammar_mask(row: torch.Tensor, state: GrammarState) -> None:
    """In place on one row of logits [vocab]: -inf on every token the state forbids next. The mask is
    computed on the CPU (llguidance's bitmask, one bit per token) and applied on the row's device."""
    vocab = row.shape[-1]
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    llguidance.torch.fill_next_token_bitmask(state.matcher, bitmask, 0)
    allowed = ((bitmask[0].unsqueeze(-1) >> _BITS) & 1).bool().reshape(-1)[:vocab]
    row.masked_fill_(~allowed.to(row.device, non_blocking=True), -math.inf)
