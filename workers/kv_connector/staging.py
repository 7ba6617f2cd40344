"""Reusable host buffers for KV on its way in or out of the pool."""

import threading

import torch

MIN_BUFFER_BYTES = 1 << 20


def buffer_size(nbytes: int) -> int:
    """Buffers come in powers of two (at least 1 MiB), so that one serves many transfer sizes."""
    return max(MIN_BUFFER_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())


class StagingPool:
    """A fresh buffer's first touch costs far more than copying into a warm one, so buffers are kept (up
    to `keep_bytes` of idle ones) and handed out again; pinned on CUDA hosts so copies to and from the
    GPU run asynchronously. Thread-safe."""

    def __init__(self, pin: bool = False, keep_bytes: int = 1 << 30) -> None:
        self._pin = pin
        self._keep_bytes = keep_bytes
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fitting = [i for i, b in enumerate(self._idle) if b.numel() >= nbytes]
            if fitting:  # (by position: tensors compare element-wise, so list.remove would not do)
                return self._idle.pop(min(fitting, key=lambda i: self._idle[i].numel()))
        return self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(buffer_size(nbytes), dtype=torch.uint8, pin_memory=self._pin)
        buffer.fill_(0)
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._idle.append(buffer)
            while sum(b.numel() for b in self._idle) > self._keep_bytes:
                self._idle.pop(min(range(len(self._idle)), key=lambda i: self._idle[i].numel()))

    @property
    def num_idle(self) -> int:
        with self._lock:
            return len(self._idle)
