"""KV transfer bandwidth between two hosts (network namespaces joined by veth links and a bridge), per data
path, against a raw TCP stream across the same link:

    .venv/bin/python -m bench.hosts.transfer [--sizes-mb 1 16 64 256] [--repeats 3]

  raw tcp    sendall / recv_into of one warm buffer over one warm connection, prefill host to decode host
  tcp path   the workers' data path: chunks sent from a KV pool, framed, checksummed, checked on arrival
  nixl path  chunks written one-sided by NIXL (UCX over the link) into the receiver's registered buffer

The decode side (`receive`) runs in one host's namespace, the prefill side (`send`) in the other's; both
are started by `main`, which makes the namespaces and removes them after. Each figure is the median of the
repeats (interleaved by path), from the first chunk to the receiver's acknowledgement. Both hosts run
with UCX_TLS=tcp (`--ucx-tls`): the namespaces share one kernel, and UCX's default would see one node
and move NIXL's bytes through shared memory, never touching the link. `link MB` is what
the prefill host's interface sent during that path's transfers, divided by the repeats: about the
payload when the bytes crossed the link, near zero when they went some other way.
"""

import argparse
import json
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

import numpy as np

from bench.hosts.network import INNER_LINK, Network
from bench.kv_transfer import CHUNKS, LAYOUT, PoolRunner
from workers.engine.kv_transfer import Peer
from workers.kv_connector.nixl import nixl_staging
from workers.kv_connector.receiver import KvInbox, KvReceiver
from workers.kv_connector.sender import KvSender
from workers.kv_connector.wire import SOCKET_BUFFER_BYTES

PATHS = ("raw tcp", "tcp", "nixl")
RAW_PORT = 7301
TOKEN = b"token"
RUN_TIMEOUT_S = 540.0


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _buffers(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


# ---- the decode host ------------------------------------------------------------------------------


def receive(host: str, transfers: int, max_bytes: int) -> None:
    """The data port (with NIXL) expecting requests bench-0.., and a raw TCP receiver; prints the data
    port, then serves until stdin closes."""
    inbox = KvInbox()
    max_tokens = max_bytes // LAYOUT.block_nbytes * LAYOUT.block_size + LAYOUT.block_size
    for index in range(transfers):
        inbox.expect(f"bench-{index}", TOKEN, lambda kv: getattr(kv, "release", lambda: None)(), max_tokens)
    receiver = KvReceiver(inbox, LAYOUT, host=host, nixl=nixl_staging("on", "decode", host))
    receiver.start()
    raw = socket.socket()
    _buffers(raw)
    raw.bind((host, RAW_PORT))
    raw.listen()
    target = np.ones(max_bytes, dtype=np.uint8)
    threading.Thread(target=_serve_raw, args=(raw, target), daemon=True).start()
    print(json.dumps({"data_port": receiver.port}), flush=True)
    try:
        sys.stdin.read()
    finally:
        receiver.close()


def _serve_raw(listener: socket.socket, target: np.ndarray) -> None:
    conn, _ = listener.accept()
    with conn:
        while header := conn.recv(8, socket.MSG_WAITALL):
            (size,) = struct.unpack("<Q", header)
            view, got = target.data[:size], 0
            while got < size:
                got += conn.recv_into(view[got:])
            conn.sendall(b"k")


# ---- the prefill host -----------------------------------------------------------------------------


class PrefillSide:
    def __init__(self, peer_host: str, data_port: int, max_blocks: int) -> None:
        self.peer_host, self.data_port = peer_host, data_port
        self.runner = PoolRunner(max_blocks)
        local = local_address()
        self.sender = KvSender(LAYOUT, nixl=nixl_staging("on", "prefill", local))
        self.raw = socket.create_connection((peer_host, RAW_PORT))
        _buffers(self.raw)
        self.counter = 0

    def run(self, path: str, num_blocks: int) -> float:
        if path == "raw tcp":
            return self._raw(num_blocks * LAYOUT.block_nbytes)
        request_id = f"bench-{self.counter}"
        self.counter += 1
        peer = Peer(self.peer_host, self.data_port, same_host=False, nixl=path == "nixl")
        outgoing = self.sender.open(request_id, TOKEN, [5] * (num_blocks * LAYOUT.block_size), peer)
        assert outgoing.data_path == path, (outgoing.data_path, path)
        sent: list[int] = []
        thread = threading.Thread(target=lambda: sent.append(outgoing.send()))
        thread.start()
        time.sleep(0.02)  # the connection opens while the prefill computes
        blocks, step = list(range(num_blocks)), -(-num_blocks // CHUNKS)
        started = time.perf_counter()
        for first in range(0, num_blocks, step):
            outgoing.write_blocks(self.runner, blocks[first : first + step], first)
        outgoing.finish(7)
        thread.join()
        elapsed = time.perf_counter() - started
        assert sent == [num_blocks * LAYOUT.block_nbytes], sent
        return elapsed

    def _raw(self, nbytes: int) -> float:
        source = self.runner.kv.numpy().reshape(-1).view(np.uint8)[:nbytes]
        started = time.perf_counter()
        self.raw.sendall(struct.pack("<Q", nbytes))
        self.raw.sendall(source.data)
        assert self.raw.recv(1) == b"k"
        return time.perf_counter() - started


def local_address() -> str:
    """This host's address on its link (what the prefill worker would serve on)."""
    lines = subprocess.run(["ip", "-4", "-o", "address", "show", INNER_LINK], capture_output=True, text=True).stdout
    return lines.split()[3].split("/")[0]


def link_tx_bytes() -> int:
    with open(f"/sys/class/net/{INNER_LINK}/statistics/tx_bytes") as counter:
        return int(counter.read())


def send(peer_host: str, data_port: int, sizes_mb: list[int], repeats: int) -> None:
    """Runs every path at every size, interleaved; prints one JSON line of figures."""
    max_blocks = max(blocks_for(size) for size in sizes_mb)
    side = PrefillSide(peer_host, data_port, max_blocks)
    for path in PATHS:  # warm every path once: connections, registrations, first touch of the buffers
        side.run(path, blocks_for(sizes_mb[0]))
    figures = []
    for size in sizes_mb:
        num_blocks = blocks_for(size)
        times: dict[str, list[float]] = {path: [] for path in PATHS}
        link: dict[str, int] = dict.fromkeys(PATHS, 0)
        for _ in range(repeats):
            for path in PATHS:
                before = link_tx_bytes()
                times[path].append(side.run(path, num_blocks))
                link[path] += link_tx_bytes() - before
        nbytes = num_blocks * LAYOUT.block_nbytes
        for path in PATHS:
            rate = nbytes / statistics.median(times[path]) / 1e9
            figures.append({"mb": size, "path": path, "gbps": rate, "link_mb": link[path] / repeats / 1e6})
        progress(f"{size} MB done")
    print(json.dumps(figures), flush=True)


def blocks_for(size_mb: int) -> int:
    return max(1, (size_mb << 20) // LAYOUT.block_nbytes)


# ---- the run --------------------------------------------------------------------------------------


def table(figures: list[dict]) -> str:
    sizes = sorted({f["mb"] for f in figures})
    by = {(f["mb"], f["path"]): f for f in figures}
    lines = [
        "| MB | " + " | ".join(f"{p} GB/s" for p in PATHS) + " | " + " | ".join(f"{p} link MB" for p in PATHS) + " |"
    ]
    lines.append("|" + " --- |" * (1 + 2 * len(PATHS)))
    for size in sizes:
        rates = " | ".join(f"{by[size, p]['gbps']:.2f}" for p in PATHS)
        link = " | ".join(f"{by[size, p]['link_mb']:.1f}" for p in PATHS)
        lines.append(f"| {size} | {rates} | {link} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--ucx-tls",
        default="tcp",
        help="UCX_TLS for both hosts (default tcp: on one machine UCX's default takes shared memory, not the link)",
    )
    parser.add_argument("--role", choices=["receive", "send"], help=argparse.SUPPRESS)
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--data-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    transfers = (len(args.sizes_mb) * args.repeats + 1) * len(PATHS)
    if args.role == "receive":
        receive(args.host, transfers, max(args.sizes_mb) << 20)
    elif args.role == "send":
        send(args.host, args.data_port, args.sizes_mb, args.repeats)
    else:
        os.environ["UCX_TLS"] = args.ucx_tls
        print(table(run_across_hosts(args.sizes_mb, args.repeats)))


def run_across_hosts(sizes_mb: list[int], repeats: int) -> list[dict]:
    me = [sys.executable, "-m", "bench.hosts.transfer", "--sizes-mb", *map(str, sizes_mb), "--repeats", str(repeats)]
    with Network(["prefill", "decode"]) as network:
        prefill, decode = network.hosts["prefill"], network.hosts["decode"]
        receiver = subprocess.Popen(
            decode.command(*me, "--role", "receive", "--host", decode.address),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        network.before_teardown.append(receiver.kill)
        assert receiver.stdin is not None and receiver.stdout is not None
        try:
            data_port = json.loads(receiver.stdout.readline())["data_port"]
            sender = subprocess.run(
                prefill.command(*me, "--role", "send", "--host", decode.address, "--data-port", str(data_port)),
                stdout=subprocess.PIPE,
                text=True,
                timeout=RUN_TIMEOUT_S,
                check=True,
            )
            return json.loads(sender.stdout.strip().splitlines()[-1])
        finally:
            receiver.stdin.close()
            try:
                receiver.wait(20)
            except subprocess.TimeoutExpired:
                receiver.send_signal(signal.SIGKILL)
                receiver.wait()


if __name__ == "__main__":
    main()
