"""The KV data path's wire protocol (DKV2) and the socket helpers both ends use.

On the wire (little-endian):
  sender → receiver  HELLO: b"DKV2", u32 length (at most MAX_HELLO_BYTES), JSON header (request id,
                     transfer token, KV layout, number of tokens, data path, shared-memory segment name,
                     and "skip_held": true from a sender that can start after blocks the receiver holds;
                     "traceparent": the W3C trace context of the sender's kv.transfer span, when traced)
  receiver → sender  REPLY: u32 length, JSON {"ok": true} or {"ok": false, "code", "error"}; to a sender that
                     said "skip_held", {"ok": true, "held_blocks": n}: the receiver's prefix cache already
                     holds the prompt's first n blocks (at most (number of tokens - 1) // block size)
  sender → receiver  after a reply with "held_blocks" only: the first block it sends, f ≤ n, as u32 (n, or
                     the start of a chunk it had staged already that runs across block n)
  sender → receiver  the prompt's token ids, number of tokens × u32
  sender → receiver  frames: FRAME struct (kind, first block, block count, offset, xxh3-64 checksum),
                     followed, on the TCP path, by the chunk's bytes; blocks f.. in order (a frame's first
                     block is its index in the prompt); kind KEEPALIVE keeps an idle connection alive, ABORT
                     carries a reason, END ends with the first token id (in `first_block`)
  receiver → sender  REPLY once the whole cache is in and checked.

The held blocks are an exchange both sides opt into, so DKV2 stays one version: an older sender never says
"skip_held" (the receiver then sends and reads nothing more and takes every block), an older receiver never
answers "held_blocks" (the sender then sends no first block and every block). "traceparent" is optional
in the same way: a receiver ignores keys it does not know, and a hello without one starts no trace link.
"""

import contextlib
import json
import socket
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import torch
import xxhash

from workers.runner.kv_pool import KvLayout

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

MAGIC = b"DKV2"
FRAME = struct.Struct("<cxxxIIQQ")  # kind, first block, block count, offset, checksum
CHUNK, KEEPALIVE, ABORT, END = b"C", b"K", b"X", b"E"
TOKEN_ID = struct.Struct("<I")
FIRST_BLOCK = struct.Struct("<I")
MAX_HELLO_BYTES = 4 << 10  # the hello carries no prompt: a few hundred bytes
MAX_REQUEST_ID_CHARS = 256
MAX_REPLY_BYTES = 64 << 10  # replies and abort reasons: a sentence
SOCKET_BUFFER_BYTES = 4 << 20  # larger kernel buffers: fewer, longer system calls per chunk
DATA_PATHS = ("tcp", "shm", "nixl")


class KvTransferError(Exception):
    """A KV transfer failed; `code` is the gRPC status its calls report."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def checksum(data: "ReadableBuffer") -> int:
    return xxhash.xxh3_64_intdigest(data)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- the hello --------------------------------------------------------------------------------------


def encode_hello(
    request_id: str,
    transfer_token: bytes,
    layout: KvLayout,
    num_tokens: int,
    data_path: str,
    segment: str,
    traceparent: str = "",
) -> bytes:
    fields = {"traceparent": traceparent} if traceparent else {}
    body = json.dumps(
        {
            **fields,
            "request_id": request_id,
            "transfer_token": transfer_token.hex(),
            "data_path": data_path,
            "segment": segment,
            "num_tokens": num_tokens,
            "num_layers": layout.num_layers,
            "kv_heads": layout.kv_heads,
            "head_dim": layout.head_dim,
            "block_size": layout.block_size,
            "dtype": dtype_name(layout.dtype),
            "skip_held": True,
        }
    ).encode()
    return MAGIC + struct.pack("<I", len(body)) + body


@dataclass(frozen=True)
class Hello:
    """A sender's hello, its fields checked for type and range."""

    request_id: str
    transfer_token: bytes
    num_tokens: int
    data_path: str
    segment: str = ""
    traceparent: str = ""
    skip_held: bool = False


def read_hello(sock: socket.socket, layout: KvLayout, deadline: float) -> Hello:
    """Reads and checks a hello: whole by `deadline`, at most MAX_HELLO_BYTES, complete, of this layout."""
    if recv_exact(sock, 4, "the KV hello", deadline) != MAGIC:
        raise KvTransferError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"this is not a Diptych KV stream of this version (it starts with {MAGIC!r})",
        )
    header = recv_json(sock, "the KV header", MAX_HELLO_BYTES, deadline)
    expected = [layout.num_layers, layout.kv_heads, layout.head_dim, layout.block_size, dtype_name(layout.dtype)]
    got = [header.get(name) for name in ("num_layers", "kv_heads", "head_dim", "block_size", "dtype")]
    if got != expected:
        raise KvTransferError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the KV layout (layers, kv heads, head dim, block size, dtype) {got} does not match this "
            f"worker's {expected}: both workers must serve the same model with the same block size",
        )
    return _hello_of(header)


def _hello_of(header: dict[str, Any]) -> Hello:
    """The hello's fields, each of its type: anything else is a malformed hello, refused as one."""
    request_id, token, num_tokens = header.get("request_id"), header.get("transfer_token"), header.get("num_tokens")
    if not (isinstance(request_id, str) and 0 < len(request_id) <= MAX_REQUEST_ID_CHARS):
        raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "the KV header's request_id must be a short string")
    if not (isinstance(num_tokens, int) and not isinstance(num_tokens, bool)):
        raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "the KV header's num_tokens must be an integer")
    try:
        transfer_token = bytes.fromhex(token) if isinstance(token, str) else None
    except ValueError:
        transfer_token = None
    if transfer_token is None:
        raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "the KV header's transfer_token must be hex")
    data_path = header.get("data_path")
    if not isinstance(data_path, str) or data_path not in DATA_PATHS:
        raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "the KV header names no known data path")
    segment, traceparent = header.get("segment", ""), header.get("traceparent", "")
    if not (isinstance(segment, str) and isinstance(traceparent, str)):
        raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "the KV header's segment and traceparent are strings")
    skip_held = header.get("skip_held") is True
    return Hello(request_id, transfer_token, num_tokens, data_path, segment, traceparent, skip_held)


# ---- frames -----------------------------------------------------------------------------------------


def chunk_frame(first_block: int, count: int, offset: int, digest: int) -> bytes:
    return FRAME.pack(CHUNK, first_block, count, offset, digest)


def end_frame(first_token_id: int) -> bytes:
    return FRAME.pack(END, first_token_id, 0, 0, 0)


def keepalive_frame() -> bytes:
    return FRAME.pack(KEEPALIVE, 0, 0, 0, 0)


def abort_frame(reason: str) -> bytes:
    body = json.dumps({"reason": reason}).encode()
    return FRAME.pack(ABORT, 0, 0, 0, 0) + struct.pack("<I", len(body)) + body


# ---- replies ----------------------------------------------------------------------------------------


def send_json(sock: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message).encode()
    sock.sendall(struct.pack("<I", len(body)) + body)


def try_send_json(sock: socket.socket, message: dict[str, Any]) -> None:
    """Sends a last word to a peer that may already be gone."""
    with contextlib.suppress(OSError):
        send_json(sock, message)


def recv_json(
    sock: socket.socket, what: str, limit: int = MAX_REPLY_BYTES, deadline: float | None = None
) -> dict[str, Any]:
    (length,) = struct.unpack("<I", recv_exact(sock, 4, what, deadline))
    if length > limit:
        raise KvTransferError(
            grpc.StatusCode.INVALID_ARGUMENT, f"the {what} is too large ({length} bytes; at most {limit})"
        )
    try:
        message = json.loads(recv_exact(sock, length, what, deadline))
    except ValueError:
        raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, f"the {what} is not valid JSON") from None
    if not isinstance(message, dict):
        raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, f"the {what} is not a JSON object")
    return message


def max_held_blocks(num_tokens: int, block_size: int) -> int:
    """The most leading blocks a receiver may hold of a prompt: the last token's KV always moves (the
    first token's logits came from it, and the receiver checks that it arrived)."""
    return max(0, (num_tokens - 1) // block_size)


def held_blocks_of(reply: dict[str, Any], num_tokens: int, block_size: int) -> int:
    """The leading blocks the receiver's hello reply says it holds, checked against what it may hold."""
    held = reply.get("held_blocks", 0)
    limit = max_held_blocks(num_tokens, block_size)
    if isinstance(held, bool) or not isinstance(held, int) or not 0 <= held <= limit:
        raise KvTransferError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the decode worker claims to hold {held!r} leading KV blocks of a prompt of {num_tokens} tokens; "
            f"it may hold a whole number from 0 to {limit} (the block holding the last token always moves)",
        )
    return held


def error_reply(error: KvTransferError) -> dict[str, Any]:
    return {"ok": False, "code": error.code.name, "error": str(error)}


def check_reply(reply: dict[str, Any]) -> None:
    if not reply.get("ok"):
        code = getattr(grpc.StatusCode, str(reply.get("code")), grpc.StatusCode.UNKNOWN)
        raise KvTransferError(code, f"the decode worker refused the KV cache: {reply.get('error')}")


def reply_after_close(sock: socket.socket) -> dict[str, Any]:
    """The receiver's last word after it broke the connection, when it left one."""
    try:
        return recv_json(sock, "the decode worker's reason for closing")
    except (KvTransferError, OSError):
        return {"ok": True}


# ---- sockets ----------------------------------------------------------------------------------------


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def recv_into(sock: socket.socket, view: memoryview, what: str, deadline: float | None = None) -> None:
    """Fills `view`; by `deadline` (time.monotonic()) in all when given, so a trickle cannot hold on."""
    received = 0
    while received < len(view):
        try:
            if deadline is not None:
                sock.settimeout(_until(deadline))
            count = sock.recv_into(view[received:])
        except TimeoutError:
            raise KvTransferError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"the KV transfer stalled while receiving {what}"
            ) from None
        if count == 0:
            raise KvTransferError(
                grpc.StatusCode.DATA_LOSS,
                f"the KV stream was cut off while receiving {what} ({received} of {len(view)} bytes)",
            )
        received += count


def recv_exact(sock: socket.socket, nbytes: int, what: str, deadline: float | None = None) -> bytes:
    buffer = bytearray(nbytes)
    recv_into(sock, memoryview(buffer), what, deadline)
    return bytes(buffer)


def sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Sends every view, in order, with as few system calls as the kernel allows (scatter-gather)."""
    views = [view for view in views if len(view)]
    while views:
        sent = sock.sendmsg(views[:512])
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0], sent = views[0][sent:], 0


def _until(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    return remaining
