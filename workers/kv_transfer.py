"""Moves a sequence's KV cache from a prefill worker to a decode worker over the PushKv stream.

The stream is a header, each layer's keys then values as raw bytes (split into bounded chunks), and a
CRC-32 trailer. The decode worker accepts it only for a request that is waiting for it with the same
one-time transfer token, and hands over the cache only once every byte has arrived and checked out.
"""

import asyncio
import hmac
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc
import torch

from diptych_common.proto.v1 import worker_pb2, worker_pb2_grpc
from workers.kv_cache import SequenceKV

CHUNK_BYTES = 1 << 20
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class KvTransferError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ReceivedKv:
    prompt_token_ids: list[int]
    first_token_id: int
    kv: SequenceKV


def kv_chunks(
    request_id: str, transfer_token: bytes, prompt_token_ids: list[int], first_token_id: int, kv: SequenceKV
) -> Iterator[worker_pb2.KvChunk]:
    keys0 = kv.layers[0][0]
    yield worker_pb2.KvChunk(header=worker_pb2.KvHeader(
        request_id=request_id,
        transfer_token=transfer_token,
        prompt_token_ids=prompt_token_ids,
        first_token_id=first_token_id,
        num_layers=len(kv.layers),
        dtype=str(keys0.dtype).removeprefix("torch."),
        shape=list(keys0.shape),
    ))
    crc = 0
    for layer, (keys, values) in enumerate(kv.layers):
        for is_value, tensor in ((False, keys), (True, values)):
            data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
            crc = zlib.crc32(data, crc)
            for start in range(0, len(data), CHUNK_BYTES):
                yield worker_pb2.KvChunk(tensor=worker_pb2.KvTensor(
                    layer=layer, is_value=is_value, data=data[start:start + CHUNK_BYTES]
                ))
    yield worker_pb2.KvChunk(trailer=worker_pb2.KvTrailer(crc32=crc))


@dataclass
class _Slot:
    registered: asyncio.Event = field(default_factory=asyncio.Event)
    transfer_token: bytes = b""
    kv: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class KvInbox:
    """Where a decode worker's waiting requests meet the KV caches pushed to it. Either side may come
    first: a push waits up to `arrival_timeout` seconds for its request to be registered."""

    def __init__(self, arrival_timeout: float = 5.0) -> None:
        self._arrival_timeout = arrival_timeout
        self._slots: dict[str, _Slot] = {}
        self.bytes_received = 0

    def expect(self, request_id: str, transfer_token: bytes) -> asyncio.Future:
        """Registers a request; the future resolves to its ReceivedKv."""
        slot = self._slots.setdefault(request_id, _Slot())
        slot.transfer_token = transfer_token
        slot.registered.set()
        return slot.kv

    def forget(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None and not slot.kv.done():
            slot.kv.cancel()

    async def receive(self, chunks: AsyncIterator[worker_pb2.KvChunk]) -> int:
        """Consumes one PushKv stream; returns the bytes received. Raises KvTransferError."""
        first = await anext(chunks, None)
        if first is None or not first.HasField("header"):
            raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "a KV stream must start with a header")
        header = first.header
        slot = await self._claim(header)
        try:
            layers, nbytes = await _read_layers(header, chunks)
        except KvTransferError as error:
            if not slot.kv.done():
                slot.kv.set_exception(error)
            raise
        self.bytes_received += nbytes
        if not slot.kv.done():
            slot.kv.set_result(ReceivedKv(list(header.prompt_token_ids), header.first_token_id, SequenceKV(layers)))
        return nbytes

    async def _claim(self, header: worker_pb2.KvHeader) -> _Slot:
        slot = self._slots.setdefault(header.request_id, _Slot())
        try:
            await asyncio.wait_for(slot.registered.wait(), self._arrival_timeout)
        except TimeoutError:
            if self._slots.get(header.request_id) is slot and not slot.registered.is_set():
                del self._slots[header.request_id]
            raise KvTransferError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no decode request for {header.request_id} is waiting for its KV cache",
            ) from None
        if not hmac.compare_digest(slot.transfer_token, header.transfer_token):
            raise KvTransferError(grpc.StatusCode.PERMISSION_DENIED, "the KV transfer token does not match")
        if slot.kv.done():
            raise KvTransferError(
                grpc.StatusCode.PERMISSION_DENIED, f"the KV cache of {header.request_id} was already delivered"
            )
        return slot


async def _read_layers(
    header: worker_pb2.KvHeader, chunks: AsyncIterator[worker_pb2.KvChunk]
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    dtype = _DTYPES.get(header.dtype)
    if dtype is None or len(header.shape) != 3 or header.num_layers == 0:
        raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "the KV header's dtype or shape is invalid")
    shape = tuple(header.shape)
    tensor_bytes = shape[0] * shape[1] * shape[2] * dtype.itemsize
    tensors: list[torch.Tensor] = []
    crc = 0
    buffer = bytearray()
    async for chunk in chunks:
        if chunk.HasField("trailer"):
            if len(tensors) != 2 * header.num_layers or buffer:
                raise KvTransferError(grpc.StatusCode.DATA_LOSS, "the KV stream ended before every layer arrived")
            if chunk.trailer.crc32 != crc:
                raise KvTransferError(grpc.StatusCode.DATA_LOSS, "the KV cache failed its CRC-32 check")
            layers = [(tensors[i], tensors[i + 1]) for i in range(0, len(tensors), 2)]
            return layers, tensor_bytes * len(tensors)
        expected = (len(tensors) // 2, len(tensors) % 2 == 1)
        if not chunk.HasField("tensor") or (chunk.tensor.layer, chunk.tensor.is_value) != expected:
            raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "KV tensors arrived out of order")
        buffer += chunk.tensor.data
        if len(buffer) > tensor_bytes:
            raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "a KV tensor is larger than its header says")
        if len(buffer) == tensor_bytes:
            crc = zlib.crc32(buffer, crc)
            tensors.append(torch.frombuffer(buffer, dtype=dtype).reshape(shape))
            buffer = bytearray()
    raise KvTransferError(grpc.StatusCode.DATA_LOSS, "the KV stream ended without its trailer")


class KvSender:
    """Pushes KV caches to decode workers, keeping one channel per decode worker."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.bytes_sent = 0

    async def push(self, address: str, chunks: Iterator[worker_pb2.KvChunk], timeout: float) -> int:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        ack = await worker_pb2_grpc.WorkerStub(channel).PushKv(chunks, timeout=timeout)
        self.bytes_sent += ack.bytes_received
        return ack.bytes_received

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
