"""Which attention a runner's layers use. A backend plans each step once (its metadata, on the device)
and each layer then attends in one call (`StepAttention.attend`):

- `gather` (`workers.models.attention`): decoding inputs in padded groups and each prompt chunk on its
  own, over keys and values gathered from the pool, through `scaled_dot_product_attention`. Any device
  and dtype; the one the CPU runs.
- `flash-varlen` (`workers.models.flash_varlen`): the whole step in one FlashAttention call per layer,
  reading the pool in place. CUDA, half precision, blocks of a multiple of 256 tokens.

`auto` takes `flash-varlen` where it can run and `gather` elsewhere, and says why.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch

from workers.models.flash_varlen import unavailable_reason

if TYPE_CHECKING:
    from workers.models.attention import Window

log = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "gather", "flash-varlen")


class StepAttention(Protocol):
    sample_rows: list[int]

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_kv: torch.Tensor,
        scale: float,
        window: Window,
    ) -> torch.Tensor: ...


class AttentionBackendUnavailable(ValueError):
    pass


def choose_backend(requested: str, device: torch.device, dtype: torch.dtype, block_size: int) -> str:
    """The backend a runner uses: `requested` if it can run here (else AttentionBackendUnavailable, with
    why); for `auto`, flash-varlen where it can run, else gather."""
    if requested not in ATTENTION_BACKENDS:
        raise AttentionBackendUnavailable(f"no attention backend {requested!r}: choose one of {ATTENTION_BACKENDS}")
    if requested == "gather":
        return requested
    reason = unavailable_reason(device, dtype, block_size)
    if reason is None:
        return "flash-varlen"
    if requested == "flash-varlen":
        raise AttentionBackendUnavailable(reason)
    if device.type == "cuda":
        log.info("attention backend: gather (%s)", reason)
    return "gather"
