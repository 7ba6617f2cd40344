"""Which attention a runner's layers use. A backend plans each step once (its metadata, on the device)
and each layer then attends in one call (`StepAttention.attend`):

- `gather` (`workers.models.attention`): decoding inputs in padded groups and each prompt chunk on its
  own, over keys and values gathered from the pool, through `scaled_dot_product_attention`. Any device
  and dtype; where neither of the others can run.
- `paged-cpu` (`workers.models.paged_cpu`): every decoding row in one C++ operator call per layer over the
  pool in place; prompt chunks as `gather` has them. CPU, float32, a C++ compiler on the machine.
- `flash-varlen` (`workers.models.flash_varlen`): the whole step in one FlashAttention call per layer,
  reading the pool in place. CUDA, half precision, blocks of a multiple of 256 tokens, a torch whose
  `varlen_attn` reads block tables.
- `triton` (`workers.models.triton_attention`): the whole step in one Triton kernel launch per layer,
  reading the pool in place, split-KV for a few rows over long contexts. CUDA with triton installed, any
  block size, float16, bfloat16 or float32; on the CPU only under Triton's interpreter (TRITON_INTERPRET=1),
  which the tests use.

`auto` takes `flash-varlen` where it can run, else `triton` on CUDA where it can, else `paged-cpu` where it
can, else `gather`, and says why. It never takes the interpreted `triton` on the CPU: far too slow to serve.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch

from workers.models import flash_varlen, paged_cpu, triton_attention

if TYPE_CHECKING:
    from workers.models.attention import Window

log = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "gather", "paged-cpu", "flash-varlen", "triton")


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
    why); for `auto`, the first of flash-varlen, triton (on CUDA) and paged-cpu that can run, else gather."""
    if requested not in ATTENTION_BACKENDS:
        raise AttentionBackendUnavailable(f"no attention backend {requested!r}: choose one of {ATTENTION_BACKENDS}")
    if requested == "gather":
        return requested
    reasons = {
        "flash-varlen": lambda: flash_varlen.unavailable_reason(device, dtype, block_size),
        "triton": lambda: triton_attention.unavailable_reason(device, dtype),
        "paged-cpu": lambda: paged_cpu.unavailable_reason(device, dtype),
    }
    if requested != "auto":
        reason = reasons[requested]()
        if reason is not None:
            raise AttentionBackendUnavailable(reason)
        return requested
    why_not = []
    for backend in ("flash-varlen", "triton", "paged-cpu"):
        if backend == "triton" and device.type != "cuda":
            why_not.append("triton: auto takes it on CUDA only (on the CPU it runs interpreted, for tests)")
            continue
        reason = reasons[backend]()
        if reason is None:
            return backend
        why_not.append(f"{backend}: {reason}")
    log.info("attention backend: gather (%s)", "; ".join(why_not))
    return "gather"
