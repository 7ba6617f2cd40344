"""KV transfer bandwidth on this machine, every path in one run, against a raw-socket baseline.

    .venv/bin/python bench/kv_transfer.py [--sizes-mb 1 25 100] [--repeats 5]

Paths, run in interleaved rounds so that every one sees the same machine load:
  raw, alone   plain sendall / recv_into of one warm buffer over one warm loopback TCP connection, from a
               process of its own, with the same kernel buffer sizes as the data path (so the ratio
               compares protocols, not socket options): the yardstick the targets are measured against
  raw socket   the same, sent from the benchmark's own process
  tcp path     the workers' data path: each chunk's blocks sent straight from a KV pool (scatter-gather),
               framed, checksummed (xxh3-64), received into a warm staging buffer and checked
  shm path     the same-host path: chunks staged in a shared-memory segment, frames over TCP
  nixl path    chunks written one-sided by NIXL (UCX picks the transport: on loopback shared memory or TCP)
               straight out of the pool, which the sender's agent registered, into the receiver's registered
               buffer; frames over TCP
  nixl, staged the same through a registered staging buffer (what a pool that cannot be seen in place
               takes: a GPU pool, a tensor-parallel runner's)
After the rounds, for comparison:
  raw, hot     raw, alone repeated back to back: the same buffer every time, partly still in the CPU's
               caches, which no path sees in the rounds (each round's other transfers evict it)
  grpc stream  the previous hand-off's transport: a client-streaming gRPC call of 1 MiB messages
The receiving side runs in another process, as on a decode worker. Each figure is the median of the
repeats, from the first byte (the first staged chunk) to the sender holding the receiver's acknowledgement
that the whole cache arrived and checked out. The KV layout is a 12-layer model with 4 KV heads of 64 (the
100M built-in model's shape).
"""

import argparse
import asyncio
import multiprocessing
import queue
import signal
import socket
import statistics
import struct
import sys
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable
from functools import partial

import grpc
import numpy as np
import torch
import xxhash

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from workers.engine.kv_transfer import KvTransferParams, Peer
from workers.kv_connector.interfaces import LOOPBACK
from workers.kv_connector.nixl import nixl_staging
from workers.kv_connector.receiver import KvInbox, KvReceiver
from workers.kv_connector.sender import KvSender
from workers.kv_connector.wire import SOCKET_BUFFER_BYTES
from workers.runner.kv_pool import KvLayout
from workers.runner.model_runner import ModelRunner

LAYOUT = KvLayout(num_layers=12, kv_heads=4, head_dim=64, block_size=16, dtype=torch.float32)
CHUNKS = 4  # the prefill computes the prompt in this many chunks; each is sent as soon as staged
GRPC_MESSAGE = 1 << 20
GRPC_PUSH = "/bench.KvStream/Push"  # raw bytes both ways: no message types needed
TINY_LAYOUT = KvLayout(num_layers=4, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)  # diptych-tiny
OVERLAP_PROMPT_TOKENS = 2048


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- the receiving side: another process, as on a real decode worker --------------------------------


def raw_receiver_process(ready, max_bytes: int) -> None:
    """The raw socket's receiving end (u64 size, bytes, a 1-byte ack), in a process of its own: the ceiling.
    Each sender's connection is served on its own thread; the benchmark runs one transfer at a time."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    raw = socket.socket()
    _set_buffer_sizes(raw)  # before listen(), so that accepted connections inherit the window
    raw.bind(("127.0.0.1", 0))
    raw.listen()
    target = np.ones(max_bytes, dtype=np.uint8)  # written, so its pages exist before the first run
    ready.send(raw.getsockname()[1])
    while True:
        conn, _ = raw.accept()
        threading.Thread(target=_receive_raw, args=(conn, target), daemon=True).start()


def _receive_raw(conn: socket.socket, target: np.ndarray) -> None:
    with conn:
        while header := conn.recv(8, socket.MSG_WAITALL):  # transfers on one connection until it closes
            (size,) = struct.unpack("<Q", header)
            view, got = target.data[:size], 0
            while got < size:
                got += conn.recv_into(view[got:])
            conn.sendall(b"k")


def raw_sender_process(control, port: int, nbytes: int) -> None:
    """The raw socket's sending end alone in its process, so that no thread of the benchmark competes
    with it: one transfer each time `control` says so, its time sent back."""
    raw = RawSocket(port, nbytes)
    while control.recv():
        control.send(raw.run())
    raw.close()


class RawAlone:
    """Drives raw_sender_process, one transfer per `run`, so that its runs interleave with the paths'."""

    def __init__(self, context, port: int, nbytes: int) -> None:
        self._control, theirs = context.Pipe()
        self._process = context.Process(target=raw_sender_process, args=(theirs, port, nbytes), daemon=True)
        self._process.start()

    def run(self) -> float:
        self._control.send(True)
        return self._control.recv()

    def close(self) -> None:
        self._control.send(False)
        self._process.join(10)


def receiver_process(ready, max_bytes: int, requests: int) -> None:
    """Serves the receiving end of the workers'
    data port (expecting requests bench-0.. with token b"token"), and a gRPC server that takes a stream
    of 1 MiB messages (the previous hand-off's transport)."""
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so the finally below removes the probe file
    inbox = KvInbox()
    max_tokens = max_bytes // LAYOUT.block_nbytes * LAYOUT.block_size  # what the largest transfer declares
    for index in range(requests):
        inbox.expect(
            f"bench-{index}", b"token", lambda received: getattr(received, "release", lambda: None)(), max_tokens
        )
    receiver = KvReceiver(inbox, LAYOUT, nixl=nixl_staging("on", "decode", LOOPBACK))
    receiver.start()
    tiny_inbox = KvInbox()  # the overlap run: the built-in model's own KV layout
    tiny_inbox.expect(
        "overlap-0", b"token", lambda received: getattr(received, "release", lambda: None)(), OVERLAP_PROMPT_TOKENS
    )
    tiny_receiver = KvReceiver(tiny_inbox, TINY_LAYOUT)
    tiny_receiver.start()

    async def serve_grpc():
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        server = grpc.aio.server(options=options)
        push = grpc.stream_unary_rpc_method_handler(_push)  # no (de)serializers: messages are bytes
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.KvStream", {"Push": push})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready.send((receiver.port, port, tiny_receiver.port))
        await server.wait_for_termination()

    try:
        asyncio.run(serve_grpc())
    finally:
        receiver.close()
        tiny_receiver.close()


async def _push(request_iterator: AsyncIterator[bytes], _context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    parts = [part async for part in request_iterator]
    np.frombuffer(b"".join(parts), dtype=np.uint8)  # the cache assembled on the receiving side
    return struct.pack("<Q", sum(len(part) for part in parts))


# ---- the sending side -----------------------------------------------------------------------------


def _set_buffer_sizes(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


class RawSocket:
    """One warm source buffer sent over one connection kept open across runs: a warm connection is
    about twice as fast as a fresh one at 25 MB on loopback, and the ceiling is the faster of the two."""

    def __init__(self, port: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self.source = np.ones(nbytes, dtype=np.uint8)
        self.sock = socket.socket()
        _set_buffer_sizes(self.sock)
        self.sock.connect(("127.0.0.1", port))

    def run(self) -> float:
        started = time.perf_counter()
        self.sock.sendall(struct.pack("<Q", self.nbytes))
        self.sock.sendall(self.source.data)
        assert self.sock.recv(1) == b"k"
        return time.perf_counter() - started

    def close(self) -> None:
        self.sock.close()


class PoolRunner:
    """A KV pool like the model runner's, filled with random values."""

    def __init__(self, num_blocks: int) -> None:
        lay = LAYOUT
        self.kv = torch.randn(lay.num_layers, 2, num_blocks, lay.block_size, lay.kv_heads, lay.head_dim)

    layout = LAYOUT
    device = torch.device("cpu")
    block_views = ModelRunner.block_views
    pool_memory = ModelRunner.pool_memory
    start_reading_blocks = ModelRunner.start_reading_blocks
    supports_block_views = True  # a host-memory pool

    def read_blocks(self, block_ids, out) -> None:
        torch.index_select(self.kv, 2, torch.tensor(block_ids), out=out)


class DataPath:
    """The prefill side of the workers' data path, against the receiver process's data port."""

    def __init__(self, port: int, num_blocks: int) -> None:
        self.port = port
        self.runner = PoolRunner(num_blocks)
        self.sender = KvSender(LAYOUT, nixl=nixl_staging("on", "prefill", LOOPBACK))
        # pin: the sender of a pool in device memory, which stages every path's chunks
        self.staged_sender = KvSender(LAYOUT, pin=True, nixl=self.sender.nixl)
        self.counter = 0

    def transfer(self, num_blocks: int, data_path: str, staged: bool = False) -> float:
        request_id = f"bench-{self.counter}"
        self.counter += 1
        tokens = num_blocks * LAYOUT.block_size
        peer = Peer("127.0.0.1", self.port, same_host=data_path == "shm", nixl=data_path == "nixl")
        sender = self.staged_sender if staged else self.sender
        outgoing = sender.open(request_id, b"token", [5] * tokens, peer)
        assert outgoing.data_path == data_path
        result: queue.Queue[int] = queue.Queue()
        thread = threading.Thread(target=lambda: result.put(outgoing.send()))
        thread.start()
        time.sleep(0.02)  # the connection opens while the prefill computes, before the first chunk
        blocks = list(range(num_blocks))
        step = -(-num_blocks // CHUNKS)
        started = time.perf_counter()
        for first in range(0, num_blocks, step):
            outgoing.write_blocks(self.runner, blocks[first : first + step], first)
        outgoing.finish(7)
        thread.join()
        elapsed = time.perf_counter() - started  # send() returns once the receiver checked every block
        assert result.get() == num_blocks * LAYOUT.block_nbytes
        return elapsed

    def close(self) -> None:
        self.sender.close()
        self.staged_sender.close()


async def grpc_stream(port: int, nbytes: int, repeats: int) -> list[float]:
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    data = np.ones(nbytes, dtype=np.uint8).tobytes()
    times = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        push: grpc.aio.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(GRPC_PUSH)

        def chunks():
            for start in range(0, nbytes, GRPC_MESSAGE):
                yield data[start : start + GRPC_MESSAGE]

        for _ in range(repeats + 1):
            started = time.perf_counter()
            ack = await push(chunks())
            times.append(time.perf_counter() - started)
            assert struct.unpack("<Q", ack)[0] == nbytes
    return times[1:]


# ---- checksums ------------------------------------------------------------------------------------


def checksum_rates(nbytes: int) -> dict[str, float]:
    data = np.ones(nbytes, dtype=np.uint8).data
    rates = {}
    for name, function in (("xxh3-64", xxhash.xxh3_64_intdigest), ("crc32 (zlib)", zlib.crc32)):
        function(data)
        started = time.perf_counter()
        for _ in range(5):
            function(data)
        rates[name] = 5 * nbytes / (time.perf_counter() - started) / 1e9
    return rates


async def overlap(data_port: int, prompt_tokens: int, token_budget: int) -> tuple[float, float, int]:
    """A real chunked prefill on the built-in model whose KV streams out while it computes: returns the
    prefill's time to its first token, the transfer time left after it, and the bytes sent."""
    from concurrent.futures import ThreadPoolExecutor

    from diptych_common.builtin import DIPTYCH_TINY
    from workers.engine.core import Engine, EngineConfig
    from workers.engine.request import EngineRequest
    from workers.engine.sampling import SamplingParams, StopCriteria
    from workers.kv_connector.prefill import PrefillConnector
    from workers.runner.model_loader import build_builtin_model

    model = build_builtin_model(DIPTYCH_TINY).eval()
    config = EngineConfig(block_size=LAYOUT.block_size, token_budget=token_budget)
    runner = ModelRunner(model, prompt_tokens // config.block_size + 2, config.block_size)
    with ThreadPoolExecutor(max_workers=1) as forward:
        engine = Engine(runner, config, StopCriteria(frozenset(), 1 << 20), forward)
        connector = PrefillConnector(KvSender(runner.layout))
        engine.attach_connector(connector)
        loop_task = asyncio.create_task(engine.run())
        prompt = [(7 * i) % 500 + 3 for i in range(prompt_tokens)]
        transfer = KvTransferParams(send_to=Peer("127.0.0.1", data_port, False), transfer_token=b"token")
        started = time.perf_counter()
        handle = engine.add(
            EngineRequest(  # its transfer connects at once, while the prompt computes
                "overlap-0",
                prompt,
                SamplingParams(temperature=0.0, max_tokens=2),
                prefill_only=True,
                kv_transfer=transfer,
            )
        )
        await handle.outputs.get()
        first_token_at = time.perf_counter()
        if handle.kv_sent is None:
            raise RuntimeError("the prefill request opened no KV transfer")
        sent = await asyncio.wrap_future(handle.kv_sent)
        delivered_at = time.perf_counter()
        loop_task.cancel()
        await connector.close()
    return first_token_at - started, delivered_at - first_token_at, sent.nbytes


def median_rate(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 25, 100])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    block_mb = LAYOUT.block_nbytes / 1e6
    max_blocks = max(1, round(max(args.sizes_mb) / block_mb))
    progress("starting the receiving process ...")
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    transfers = len(args.sizes_mb) * len(("tcp", "shm", "nixl", "nixl, staged")) * (args.repeats + 1)
    receiver = context.Process(
        target=receiver_process, args=(theirs, max_blocks * LAYOUT.block_nbytes, transfers), daemon=True
    )
    receiver.start()
    data_port, grpc_port, tiny_port = ours.recv()
    raw_ours, raw_theirs = context.Pipe()
    raw_receiver = context.Process(
        target=raw_receiver_process, args=(raw_theirs, max_blocks * LAYOUT.block_nbytes), daemon=True
    )
    raw_receiver.start()
    raw_port = raw_ours.recv()
    path = DataPath(data_port, max_blocks)
    rows = []
    try:
        for size_mb in args.sizes_mb:
            num_blocks = max(1, round(size_mb / block_mb))
            nbytes = num_blocks * LAYOUT.block_nbytes
            progress(f"{nbytes / 1e6:.1f} MB ({num_blocks} blocks of {LAYOUT.block_size} tokens):")
            raw, alone = RawSocket(raw_port, nbytes), RawAlone(context, raw_port, nbytes)
            runs: dict[str, Callable[[], float]] = {
                "raw socket": raw.run,
                "tcp path": partial(path.transfer, num_blocks, "tcp"),
                "shm path": partial(path.transfer, num_blocks, "shm"),
                "nixl path": partial(path.transfer, num_blocks, "nixl"),
                "nixl, staged": partial(path.transfer, num_blocks, "nixl", staged=True),
                "raw, alone": alone.run,
            }
            times: dict[str, list[float]] = {name: [] for name in runs}
            for repeat in range(args.repeats + 1):  # interleaved, so every path sees the same machine load
                progress(f"  round {repeat + 1} of {args.repeats + 1}" + (" (warm-up)" if repeat == 0 else ""))
                for name, run in runs.items():
                    elapsed = run()
                    if repeat:
                        times[name].append(elapsed)
            figures = {name: median_rate(nbytes, elapsed) for name, elapsed in times.items()}
            progress("  raw socket alone, back to back ...")
            alone.run()  # brings the source buffer back into the caches
            figures["raw, hot"] = median_rate(nbytes, [alone.run() for _ in range(args.repeats)])
            raw.close()
            alone.close()
            progress("  grpc stream ...")
            figures["grpc stream"] = median_rate(nbytes, asyncio.run(grpc_stream(grpc_port, nbytes, args.repeats)))
            rows.append((nbytes, figures))
        progress("overlap: a chunked prefill streaming its KV as it computes ...")
        prefill_s, tail_s, overlap_bytes = asyncio.run(
            overlap(tiny_port, prompt_tokens=OVERLAP_PROMPT_TOKENS, token_budget=256)
        )
    finally:
        path.close()
        for process in (receiver, raw_receiver):
            process.terminate()
            process.join(10)
    print(
        f"\nKV transfer on loopback, receiver in another process, median of {args.repeats}; ratio = against the"
        " raw socket of the same size sent from this process, and against the raw socket sent from a process"
        " of its own (the yardstick); both interleaved with the paths, under the same load\n"
    )
    print(f"{'size':>9}  {'path':<12} {'GB/s':>7} {'ratio':>6} {'vs alone':>8}")
    for nbytes, figures in rows:
        for name, rate in figures.items():
            print(
                f"{nbytes / 1e6:>7.1f}MB  {name:<12} {rate:>7.2f} {rate / figures['raw socket']:>6.2f}"
                f" {rate / figures['raw, alone']:>8.2f}"
            )
    print(
        f"\noverlap: diptych-tiny, 2048-token prompt in chunks of 256, {overlap_bytes / 1e6:.1f} MB of KV over the"
        f" tcp path\n  prefill to first token {prefill_s * 1000:.0f} ms; transfer left after the first token"
        f" {tail_s * 1000:.1f} ms (the rest was sent while later chunks computed)"
    )
    sys.stdout.flush()
    print("\nintegrity check cost, single thread:")
    for name, rate in checksum_rates(25 << 20).items():
        print(f"  {name:<13} {rate:>6.1f} GB/s")


if __name__ == "__main__":
    main()
