"""Paged attention in one FlashAttention call per layer, for any mix of prompt chunks and decoding tokens.

The step's queries stay packed [tokens, heads, head_dim]; `cu_seqlens_q` marks where each input's rows
start. Each input reads its keys and values where they lie in the pool, through its block table, up to its
last position (`seqused_k`): nothing is gathered. A query at position p sees the keys up to p, which is
FlashAttention's causal mask aligned to the end of the keys; a sliding window of w keys is
`window_size=(w - 1, 0)`. Grouped-query attention reads each kv head once for its group.

The kernel is the FlashAttention-2 varlen kernel that PyTorch ships for CUDA (`torch.nn.attention.varlen`):
nothing to install beside torch, half precision only, and pages of a multiple of `BLOCK_MULTIPLE` tokens,
so a runner that uses it takes blocks of 256 tokens (`--block-size 256`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch

from workers.models.attention import Window, sample_rows_of
from workers.models.device_values import on_device

if TYPE_CHECKING:
    from workers.models.step import StepInput

BLOCK_MULTIPLE = 256
HALF_PRECISION = (torch.float16, torch.bfloat16)


def unavailable_reason(device: torch.device, dtype: torch.dtype, block_size: int) -> str | None:
    """Why the backend cannot run a pool on `device` of `dtype` in blocks of `block_size` tokens; None
    when it can."""
    if device.type != "cuda":
        return f"FlashAttention varlen runs on CUDA devices only, not {device}"
    if not torch.cuda.is_available():
        return f"FlashAttention varlen runs on CUDA devices only, and this torch {torch.__version__} has none"
    if dtype not in HALF_PRECISION:
        return f"FlashAttention varlen takes float16 or bfloat16, not {dtype}"
    if block_size % BLOCK_MULTIPLE:
        return f"FlashAttention varlen reads pages of a multiple of {BLOCK_MULTIPLE} tokens: use --block-size 256"
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if "block_table" not in inspect.signature(varlen_attn).parameters:
        return f"torch {torch.__version__}'s varlen_attn reads no block tables"
    return None


class FlashVarlenPlan:
    """A step's attention metadata, built once on the device; `attend` is one kernel call per layer."""

    def __init__(self, inputs: list[StepInput], block_size: int, device: torch.device) -> None:
        self.sample_rows = sample_rows_of(inputs)
        lengths = [len(step.token_ids) for step in inputs]
        keys = [step.start + length for step, length in zip(inputs, lengths, strict=True)]
        width = max(-(-count // block_size) for count in keys)
        tables = [step.block_ids[:width] + [0] * (width - len(step.block_ids[:width])) for step in inputs]
        self.cu_seqlens_q = _offsets(lengths, device)
        self.cu_seqlens_k = _offsets(keys, device)
        self.seqused_k = on_device(keys, device, torch.int32)
        self.block_table = on_device(tables, device, torch.int32)
        self.max_q, self.max_k = max(lengths), max(keys)

    def attend(
        self,
        query: torch.Tensor,
        _key: torch.Tensor,  # the step's own keys and values, in the pool already
        _value: torch.Tensor,
        layer_kv: torch.Tensor,
        scale: float,
        window: Window,
    ) -> torch.Tensor:
        """query [tokens, heads, head_dim], the layer's pool [2, blocks, block_size, kv_heads, head_dim]
        (this step's keys and values already in it) → [tokens, heads * head_dim]."""
        from torch.nn.attention.varlen import varlen_attn

        one_split: dict[str, Any] = {"num_splits": 1} if _takes_num_splits(varlen_attn) else {}
        attended = varlen_attn(
            query,
            layer_kv[0],
            layer_kv[1],
            self.cu_seqlens_q,
            self.cu_seqlens_k,
            self.max_q,
            self.max_k,
            scale=scale,
            window_size=(-1 if window is None else window - 1, 0),
            enable_gqa=True,
            seqused_k=self.seqused_k,
            block_table=self.block_table,
            **one_split,
        )
        assert isinstance(attended, torch.Tensor)  # no auxiliary outputs were asked for
        return attended.reshape(query.shape[0], -1)


@functools.cache
def _takes_num_splits(varlen_attn: Callable[..., object]) -> bool:
    """Whether this torch's varlen_attn takes `num_splits`: where it does, the paged path is asked for one
    split, since its automatic split-KV corrupts the output (pytorch #194167, open)."""
    return "num_splits" in inspect.signature(varlen_attn).parameters


def _offsets(counts: list[int], device: torch.device) -> torch.Tensor:
    """[0, counts[0], counts[0] + counts[1], ...] as int32 on the device."""
    return on_device([0, *accumulate(counts)], device, torch.int32)
