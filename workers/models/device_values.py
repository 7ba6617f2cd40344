"""Small tensors of host values (indices, per-row parameters) for the device a step runs on."""

from collections.abc import Sequence

import torch


def on_device(
    values: Sequence[float] | Sequence[Sequence[float]], device: torch.device, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """`values` as a tensor on `device`. `torch.tensor(values, device=...)` copies and then waits until the
    device has run everything queued before the copy; this queues the copy behind that work instead, so
    the host goes on launching the step's kernels and waits once, for the step's results."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
